"""The quantization-aware training parity recipe shared by the rank program (qat_worker.py) and the one-process
reference (test_qat.py): a tiny model's Linears fake-quantized (nd_parallel/models/qat.py), trained with the parity
loop, the fake quantizers switched on before step ``fake_quant_after_n_steps`` as nd-parallel train's callback does.
"""

from __future__ import annotations

from nd_parallel.models.qat import prepare_qat, set_fake_quant
from nd_parallel.testing.parity import RunResult, train_reference


def qat_model(model_dir, options: dict, plugin=None):
    """The checkpoint with its Linears fake-quantized: on the meta device through ``plugin.from_pretrained`` (read
    later, per rank, by the layout), or loaded whole in this process."""
    from transformers import AutoModelForCausalLM

    model = plugin.from_pretrained(model_dir) if plugin is not None else AutoModelForCausalLM.from_pretrained(model_dir)
    prepare_qat(model, options)
    return model


def switch(model, options: dict):
    """``progress(step, loss)`` for train_layout: after step ``step``, the quantizers as the next step needs them."""
    n = options.get("fake_quant_after_n_steps")
    return (lambda step, loss: set_fake_quant(model, step + 1 >= n)) if n else None


def train_qat_reference(model_dir, samples, dp_size: int, recipe, options: dict) -> RunResult:
    """parity.train_reference's loop (one process, the global batch) with the quantizer switch of ``switch``."""
    model = qat_model(model_dir, options)
    return train_reference(model_dir, samples, dp_size, recipe, model=model, progress=switch(model, options))
