"""LISA (layerwise importance sampling, arXiv 2403.17919) with Axolotl 0.19's meaning, under any layout.

Axolotl's ``lisa_n_layers`` / ``lisa_step_interval`` / ``lisa_layers_attribute``: before the first optimizer
step, before the second, and then before every step whose number is a multiple of the interval, every parameter of
the decoder layers under ``lisa_layers_attribute`` is frozen and ``lisa_n_layers`` layers drawn at random without
replacement are unfrozen; parameters outside the layer stack keep their ``requires_grad``. The optimizer holds every
parameter from the start (it is built before the first switch): a frozen parameter gets no gradient, so AdamW skips
it (no update, no weight decay) and keeps its moments, which resume when the layer is drawn again.

Two choices made for the layouts, neither changing what is trained:

- **The draw.** Axolotl draws from numpy's global generator, whose position depends on whatever else used it;
  here each switch draws from a generator seeded with (seed, step), so every rank (and one process) draws the
  same layers, and a resumed run the same ones as the run it resumes (it starts with the last switch's draw). Same
  distribution: a uniform choice of ``lisa_n_layers`` distinct layers.
- **Which parameters.** The layers are found by parameter name (``<lisa_layers_attribute>.<index>.``), on the model
  the layout prepared: nd_parallel keeps Hugging Face names under FSDP2, TP, CP and PP, and under PP a stage
  simply holds only some of the layers, so each rank freezes and unfreezes the ones it owns.
"""

from __future__ import annotations

from functools import reduce

import numpy as np
from transformers import TrainerCallback


def draw_layers(seed: int, step: int, total: int, n: int) -> list[int]:
    """The ``n`` layers (of ``total``) active from ``step``: the same on every rank and in one process."""
    rng = np.random.default_rng([seed, step])
    return sorted(int(i) for i in rng.choice(total, n, replace=False))


def switches_at(step: int, interval: int) -> bool:
    """Axolotl's rule: switch before step 0, before step 1 and before every multiple of the interval."""
    return step % interval == 0 or step == 1


def last_switch(step: int, interval: int) -> int:
    """The latest switch at or before ``step`` (a resumed run starts with the layers drawn there)."""
    return max(min(step, 1), step // interval * interval)


def count_layers(model, attribute: str) -> int:
    """len(model.<attribute>), with a clear error when the attribute path does not lead to a layer list."""
    try:
        layers = reduce(getattr, attribute.split("."), model)
        return len(layers)
    except (AttributeError, TypeError):
        raise ValueError(f"lisa_layers_attribute={attribute!r} does not name a list of layers of "
                         f"{type(model).__name__}; write the path of its decoder layers, e.g. model.layers") from None


def set_active_layers(model, attribute: str, active: list[int]) -> int:
    """Freeze every parameter under ``<attribute>.<i>.``, unfreeze those of the layers in ``active``; returns how
    many parameters of this rank are under the layer stack (0 means the attribute matched nothing here)."""
    prefix, wanted, seen = attribute + ".", set(active), 0
    for name, param in model.named_parameters():
        # a wrapper may prefix the name (a PEFT model's base_model.model.): the layer stack is found inside it
        at = name.find(prefix)
        if at < 0 or (at > 0 and name[at - 1] != "."):
            continue
        index = name[at + len(prefix):].split(".", 1)[0]
        if index.isdigit():
            param.requires_grad_(int(index) in wanted)
            seen += 1
    return seen


class LISACallback(TrainerCallback):
    """Axolotl's LISA callback for a ``transformers.Trainer`` (under NDParallelCallback or alone).

    ``trainer``: the Trainer, whose prepared model (``model_wrapped``: under PP the stages this rank holds) is the
    one switched; the layers are counted on ``trainer.model`` (the whole model, every layer)."""

    def __init__(self, trainer, n_layers: int, step_interval: int, layers_attribute: str = "model.layers"):
        self.trainer, self.n, self.interval, self.attribute = trainer, n_layers, step_interval, layers_attribute
        self.total = count_layers(trainer.model, layers_attribute)
        if not 1 <= n_layers <= self.total:
            raise ValueError(f"lisa_n_layers={n_layers}: the model has {self.total} layers under "
                             f"{layers_attribute}; choose between 1 and {self.total}")
        self.active: list[int] = []

    def on_step_begin(self, args, state, control, **kwargs):
        resumed = not self.active  # the first step of this process: a resumed run takes up its last draw
        if not (switches_at(state.global_step, self.interval) or resumed):
            return control
        self.active = draw_layers(args.seed, last_switch(state.global_step, self.interval), self.total, self.n)
        model = self.trainer.model_wrapped if self.trainer.model_wrapped is not None else self.trainer.model
        if not set_active_layers(model, self.attribute, self.active) and self.trainer.is_world_process_zero():
            print(f"[nd_parallel] lisa: no parameter of this rank is under {self.attribute}", flush=True)
        if state.is_world_process_zero:
            print(f"[nd_parallel] lisa: step {state.global_step}: layers {self.active} of {self.total} train",
                  flush=True)
        return control
