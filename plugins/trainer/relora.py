"""ReLoRA (arXiv 2307.05695) with Axolotl 0.19's meaning, under any layout.

Axolotl's ``relora: true`` with ``jagged_restart_steps: N``: before every optimizer step whose number is a positive
multiple of N, each LoRA layer's delta ``B @ A * scaling`` is added to its base weight, the adapter is initialised
again as peft initialises it (``A`` Kaiming-uniform, ``B`` zero: the model's function is unchanged), and the
optimizer's Adam moments of the adapter are pruned (``relora_prune_method``: ``magnitude`` zeroes the
``relora_prune_ratio`` smallest by absolute value, ``random`` a random share, ``reset`` is random at 0.999 unless a
ratio is given; default ratio 0.9); the step count is kept. The LR schedule's warm-up after each restart is the
scheduler's (cli/train/schedules.py, ``jagged_restart_*``).

Under a layout every tensor involved may be a DTensor (FSDP2 / HSDP shards, TP slices, or plain under DDP and on a
PP stage, which holds its own layers). Each restart makes each small tensor whole (``full_tensor``: an adapter
factor, or its moments), computes exactly what one process computes on it, and keeps this rank's piece of the result
(``distribute_tensor`` from the same whole value on every rank, no communication). The delta is formed whole and
added to this rank's piece of the base weight, so no base weight is ever gathered.

Random numbers (the new ``A``, the random pruning masks) come from a generator seeded with (seed, step, the
parameter's name), not from torch's global generator as in Axolotl: the ranks of a layout consume the global one
differently, and this makes every rank, and one process, draw the same values. Same distributions.
"""

from __future__ import annotations

import math
import re
import zlib

import torch
from transformers import TrainerCallback

FULL_RESET_RATIO = 0.999  # Axolotl's (and the paper's) "reset": random pruning of all but 0.1%
PRUNE_METHODS = ("magnitude", "random", "reset")
ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def prune_ratio(method: str, ratio: float | None) -> float:
    """Axolotl's default: 0.999 for reset, 0.9 otherwise, unless relora_prune_ratio is set."""
    if ratio is not None:
        return ratio
    return FULL_RESET_RATIO if method == "reset" else 0.9


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _assign(t: torch.Tensor, whole: torch.Tensor, add: bool = False) -> None:
    """t (a DTensor or plain tensor) = whole (or += whole): this rank's piece of a value every rank holds whole."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(t, DTensor):
        piece = distribute_tensor(whole.to(t.device), t.device_mesh, t.placements, src_data_rank=None).to_local()
        t = t.to_local()
    else:
        piece = whole.to(t.device)
    t.add_(piece.to(t.dtype)) if add else t.copy_(piece.to(t.dtype))


def generator(seed: int, step: int, name: str, what: str) -> torch.Generator:
    return keyed_generator(seed, step, zlib.crc32(f"{canonical(name)}|{what}".encode()))


def keyed_generator(seed: int, step: int, key: int) -> torch.Generator:
    """A CPU generator seeded by (seed, step, key), the same on every rank and in one process: the restarts' draws
    here, and the diffusion objective's masks keyed by a row's tokens (cli/train/diffusion.py)."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 4_294_967_311 + key) % 2**63)


# what wraps the model's own names: a PeftModel, PP's stage list, DDP, torch.compile
_WRAPPERS = re.compile(r"^(?:base_model\.model\.|stages\.\d+\.|module\.|_orig_mod\.)+")


def canonical(name: str) -> str:
    """A module's or parameter's name without the wrappers' prefixes: the same in one process and under every
    layout (``base_model.model.model.layers.0...`` in a PeftModel, ``stages.0.model.layers.0...`` under PP)."""
    return _WRAPPERS.sub("", name)


def _lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


@torch.no_grad()
def merge_and_reinit(model, seed: int, step: int, cpu_offload: bool = False) -> int:
    """Every LoRA layer of this rank: base weight += delta; A, B initialised again. Returns the layer count."""
    layers = _lora_layers(model)
    for name, layer in layers:
        if layer.lora_magnitude_vector:  # DoRA is refused in the config stage (keys.REFUSED)
            raise NotImplementedError(f"relora: {name} is a DoRA layer; ReLoRA merges plain LoRA")
        for adapter in layer.lora_embedding_A:  # LoRA on an embedding (e.g. lora_target_modules: [embed_tokens])
            _restart_embedding(layer, name, adapter, seed, step, cpu_offload)
        for adapter in layer.lora_A:
            a_param, b_param = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
            where = "cpu" if cpu_offload else a_param.device  # relora_cpu_offload: the delta formed on the CPU
            a, b = _whole(a_param).to(where), _whole(b_param).to(where)
            delta = (b @ a) * layer.scaling[adapter]
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.T
            _assign(layer.get_base_layer().weight, delta, add=True)
            # peft's init_lora_weights=True: kaiming_uniform_(a=sqrt(5)) on A, i.e. U(-1/sqrt(fan_in), +), B = 0
            bound = 1.0 / math.sqrt(a.shape[1])
            fresh = torch.empty(a.shape, dtype=torch.float32).uniform_(
                -bound, bound, generator=generator(seed, step, f"{name}.lora_A.{adapter}", "init"))
            _assign(a_param, fresh)
            _assign(b_param, torch.zeros(b.shape))
    return len(layers)


def _restart_embedding(layer, name: str, adapter: str, seed: int, step: int, cpu_offload: bool) -> None:
    """An embedding LoRA layer's restart, as Axolotl's (peft's get_delta_weight, then reset_lora_parameters):
    weight += (B @ A)^T * scaling; A = 0, B ~ N(0, 1) (nn.Embedding's init, peft's for lora_embedding_B)."""
    a_param, b_param = layer.lora_embedding_A[adapter], layer.lora_embedding_B[adapter]  # [r, vocab], [dim, r]
    where = "cpu" if cpu_offload else a_param.device
    a, b = _whole(a_param).to(where), _whole(b_param).to(where)
    _assign(layer.get_base_layer().weight, (b @ a).T * layer.scaling[adapter], add=True)
    _assign(a_param, torch.zeros(a.shape))
    fresh = torch.empty(b.shape, dtype=torch.float32).normal_(
        generator=generator(seed, step, f"{name}.lora_embedding_B.{adapter}", "init"))
    _assign(b_param, fresh)


def _inner_optimizer(optimizer):
    while hasattr(optimizer, "optimizer"):  # Accelerate's AcceleratedOptimizer, nd_parallel's step counter
        optimizer = optimizer.optimizer
    return optimizer


@torch.no_grad()
def prune_moments(model, optimizer, seed: int, step: int, method: str, ratio: float) -> tuple[int, int]:
    """Prune the Adam moments of the trainable LoRA factors (Axolotl's reset_optimizer); (zeroed, total)."""
    if method not in PRUNE_METHODS:
        raise ValueError(f"relora_prune_method={method!r}; use one of {', '.join(PRUNE_METHODS)}")
    state, zeros, total = _inner_optimizer(optimizer).state, 0, 0
    for name, param in model.named_parameters():
        if not (param.requires_grad and "lora_" in name) or not state.get(param):
            continue
        for key in ADAM_KEYS:
            value = state[param].get(key)
            if not torch.is_tensor(value):
                continue
            whole = _whole(value).clone()
            if method == "magnitude":
                magnitude = whole.abs()
                try:
                    threshold = torch.quantile(magnitude.flatten().float(), ratio).to(whole.dtype)
                except RuntimeError as err:  # Axolotl leaves a tensor above quantile's size limit unpruned
                    if "too large" in str(err):
                        continue
                    raise
                whole.mul_((magnitude > threshold).to(whole.dtype))
            else:
                keep = torch.rand(whole.shape, generator=generator(seed, step, name, key)) > ratio
                whole.mul_(keep.to(whole.device, whole.dtype))
            _assign(value, whole)
            zeros, total = zeros + int((whole == 0).sum()), total + whole.numel()
    return zeros, total


class ReLoRACallback(TrainerCallback):
    """Axolotl's ReLoRA restarts for a ``transformers.Trainer`` (under NDParallelCallback or alone): before the
    steps N, 2N, ... the prepared model (``trainer.model_wrapped``) is merged and re-initialised, and the
    Trainer's optimizer pruned. Logs ``num_lora_restarts`` as Axolotl does."""

    def __init__(self, trainer, restart_steps: int, prune_method: str | None = "magnitude",
                 ratio: float | None = None, cpu_offload: bool = False):
        self.trainer, self.every, self.cpu_offload = trainer, restart_steps, bool(cpu_offload)
        self.method = prune_method or "magnitude"
        self.ratio = prune_ratio(self.method, ratio)
        self.restarts = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.restarts = max(state.global_step - 1, 0) // self.every  # a resumed run counts the restarts it holds
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        step = state.global_step
        if step == 0 or step % self.every:
            return control
        model = self.trainer.model_wrapped if self.trainer.model_wrapped is not None else self.trainer.model
        layers = merge_and_reinit(model, args.seed, step, self.cpu_offload)
        zeros, total = prune_moments(model, self.trainer.optimizer, args.seed, step, self.method, self.ratio)
        self.restarts += 1
        if state.is_world_process_zero:
            print(f"[nd_parallel] relora: restart {self.restarts} at step {step}: {layers} LoRA layers merged and "
                  f"re-initialised; {zeros}/{total} of this rank's adapter moments zeroed ({self.method})", flush=True)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            logs["num_lora_restarts"] = self.restarts
        return control
