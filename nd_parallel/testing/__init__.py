"""Fixtures for tests, benchmarks and the demo, like ``torch.testing``: tiny models and tokenizers built locally
(models.py, tokenizer.py), the parity harness (parity.py), launch helpers (launch.py) and the chaos harness
(chaos.py, chaos_inject.py). Nothing here is used by a training run."""
