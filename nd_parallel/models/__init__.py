"""What nd_parallel knows about Hugging Face models: their structure (hf.py, the one place), memory-efficient
loading (loading.py) and PEFT adapters (peft.py)."""
