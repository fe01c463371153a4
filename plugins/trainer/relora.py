"""ReLoRA (arXiv 2307.05695) with Axolotl 0.19's meaning, under any layout.

Axolotl's ``relora: true`` with ``jagged_restart_steps: N``: before every optimizer step whose number is a positive
multiple of N, each LoRA layer's delta ``B @ A * scaling`` is added to its base weight, the adapter is initialised
again as peft initialises it (``A`` Kaiming-uniform, ``B`` zero: the model's function is unchanged), and the
optimizer's Adam moments of the adapter are pruned (``relora_prune_method``: ``magnitude`` zeroes the
``relora_prune_ratio`` smallest by absolute value, ``random`` a random share, ``reset`` is random at 0.999 unless a
ratio is given; default ratio 0.9); the step count is kept. The LR schedule's warm-up after each restart is the
scheduler's (cli/train/schedules.py, ``jagged_restart_*``). On a quantized base (QLoRA, LoRA on 8-bit) the delta
goes into the layer's float weight, which is quantized again (relora_quantized.py).

The moments pruned are AdamW's ``exp_avg`` / ``exp_avg_sq`` and bitsandbytes' ``state1`` / ``state2`` (its 8-bit
and paged optimizers), by their values: an 8-bit moment is decoded from its code and its block's absmax, and a
pruned one takes the code of 0. **Found:** Axolotl prunes the uint8 codes themselves (``tensor.mul_(mask)``), so a
pruned first moment takes code 0, which bitsandbytes' signed map decodes as -0.993 x the block's absmax, not 0, and
its magnitude pruning ranks codes, not values (for the signed first moment the smallest codes are the most negative
values).

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
BNB_KEYS = ("state1", "state2")  # bitsandbytes' Adam moments (8-bit codes, or fp32 for small tensors)


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


def tokens_key(tokens: torch.Tensor) -> int:
    """A row's key for ``keyed_generator``: its tokens' checksum, the same wherever the row lands."""
    return zlib.crc32(tokens.cpu().numpy().tobytes())


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


def _delta(layer, adapter: str, where) -> torch.Tensor:
    """A Linear LoRA layer's B @ A x scaling, whole, as [out, in] (transposed where the layer is fan-in-fan-out)."""
    a, b = _whole(layer.lora_A[adapter].weight).to(where), _whole(layer.lora_B[adapter].weight).to(where)
    delta = (b @ a) * layer.scaling[adapter]
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


@torch.no_grad()
def merge_and_reinit(model, seed: int, step: int, cpu_offload: bool = False, master=None) -> int:
    """Every LoRA layer of this rank: base weight += delta; A, B initialised again. A quantized base layer takes
    the delta through its float weight in ``master`` (relora_quantized.FloatMaster), which every rank must pass
    (it gathers and waits for the others). Returns the layer count."""
    from .relora_quantized import quantized_weight, requantize

    layers = _lora_layers(model)
    quantized = {f"{canonical(name)}.weight": layer for name, layer in layers if quantized_weight(layer) is not None}
    if quantized and master is None:
        raise ValueError("relora: a LoRA layer of a quantized base needs its float weight (a FloatMaster)")
    floats = master.read(list(quantized), step) if master is not None else {}
    for name, layer in layers:
        if layer.lora_magnitude_vector:  # DoRA is refused in the config stage (keys.REFUSED)
            raise NotImplementedError(f"relora: {name} is a DoRA layer; ReLoRA merges plain LoRA")
        for adapter in layer.lora_embedding_A:  # LoRA on an embedding (e.g. lora_target_modules: [embed_tokens])
            _restart_embedding(layer, name, adapter, seed, step, cpu_offload)
        for adapter in layer.lora_A:
            a_param, b_param = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
            where = "cpu" if cpu_offload else a_param.device  # relora_cpu_offload: the delta formed on the CPU
            key = f"{canonical(name)}.weight"
            if key in quantized:  # float weight + delta, quantized again (relora_quantized.py)
                floats[key] = floats[key].to(where) + _delta(layer, adapter, where).float()
                requantize(layer, floats[key])
            else:
                _assign(layer.get_base_layer().weight, _delta(layer, adapter, where), add=True)
            # peft's init_lora_weights=True: kaiming_uniform_(a=sqrt(5)) on A, i.e. U(-1/sqrt(fan_in), +), B = 0
            bound = 1.0 / math.sqrt(a_param.shape[1])
            fresh = torch.empty(a_param.shape, dtype=torch.float32).uniform_(
                -bound, bound, generator=generator(seed, step, f"{name}.lora_A.{adapter}", "init"))
            _assign(a_param, fresh)
            _assign(b_param, torch.zeros(b_param.shape))
    if master is not None:
        master.write(floats, step)
    return len(layers)


@torch.no_grad()
def merged_floats(model, master, step: int) -> None:
    """The end of a ReLoRA run on a quantized base: every LoRA layer's merged float weight (quantized ones: their
    float weight + delta; float ones: weight + delta) written to ``master``'s folder for ``step``; the model is not
    changed. Every rank must call it."""
    from .relora_quantized import quantized_weight

    layers = _lora_layers(model)
    quantized = [f"{canonical(name)}.weight" for name, layer in layers if quantized_weight(layer) is not None]
    floats = master.read(quantized, step)
    for name, layer in layers:
        key = f"{canonical(name)}.weight"
        if key not in floats:
            floats[key] = _whole(layer.get_base_layer().weight).float().cpu()
        for adapter in layer.lora_A:
            floats[key] = floats[key] + _delta(layer, adapter, "cpu").float()
        for adapter in layer.lora_embedding_A:  # peft's embedding delta: (B @ A)^T x scaling
            a, b = _whole(layer.lora_embedding_A[adapter]).cpu(), _whole(layer.lora_embedding_B[adapter]).cpu()
            floats[key] = floats[key] + ((b @ a).T * layer.scaling[adapter]).float()
    master.write(floats, step)


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


def _values(state: dict, key: str) -> torch.Tensor:
    """A state entry's values: bitsandbytes' 8-bit ``state1`` / ``state2`` decoded from their uint8 codes (the
    map ``qmap<n>`` scaled by each block's ``absmax<n>``), else the entry itself."""
    value = state[key]
    if value.dtype != torch.uint8:
        return value
    n = key[-1]
    from nd_parallel.distributed.optimizer_8bit import BLOCK

    flat = state[f"qmap{n}"][value.flatten().long()] * state[f"absmax{n}"].repeat_interleave(BLOCK)[:value.numel()]
    return flat.view(value.shape)


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _gathered(values: torch.Tensor, param) -> torch.Tensor:
    """The whole tensor of a state entry: a DTensor's, or a local shard's (bitsandbytes steps local shards of
    DTensor parameters, distributed/optimizer_8bit.py) placed as its parameter is."""
    from torch.distributed.tensor import DTensor

    if isinstance(values, DTensor) or not isinstance(param, DTensor):
        return _whole(values)
    return DTensor.from_local(values, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride()).full_tensor()


def _local(whole: torch.Tensor, param) -> torch.Tensor:
    """This rank's piece of a whole tensor shaped like ``param`` (plain: the whole)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return whole
    return distribute_tensor(whole.to(param.device), param.device_mesh, param.placements,
                             src_data_rank=None).to_local()


@torch.no_grad()
def prune_moments(model, optimizer, seed: int, step: int, method: str, ratio: float) -> tuple[int, int]:
    """Prune the Adam moments of the trainable LoRA factors (Axolotl's reset_optimizer); (zeroed, total). AdamW's
    ``exp_avg`` / ``exp_avg_sq`` and bitsandbytes' ``state1`` / ``state2`` (8-bit codes: pruned by their values,
    a pruned value takes the code of 0)."""
    if method not in PRUNE_METHODS:
        raise ValueError(f"relora_prune_method={method!r}; use one of {', '.join(PRUNE_METHODS)}")
    inner = _inner_optimizer(optimizer)
    local_of = {id(p): local for p, local in getattr(inner, "nd_parallel_local_shards", [])}
    zeros, total = 0, 0
    for name, param in model.named_parameters():
        state = inner.state.get(local_of.get(id(param), param)) if param.requires_grad and "lora_" in name else None
        if not state:
            continue
        for key in (*ADAM_KEYS, *BNB_KEYS):
            if not torch.is_tensor(state.get(key)):
                continue
            whole = _gathered(_values(state, key), param).float()
            if method == "magnitude":
                try:
                    threshold = torch.quantile(whole.abs().flatten(), ratio)
                except RuntimeError as err:  # Axolotl leaves a tensor above quantile's size limit unpruned
                    if "too large" in str(err):
                        continue
                    raise
                keep = whole.abs() > threshold
            else:
                keep = torch.rand(whole.shape, generator=generator(seed, step, name, key)) > ratio
            value, kept = state[key], _local(keep.to(whole.device), param)
            if value.dtype == torch.uint8:
                zero = int(state[f"qmap{key[-1]}"].abs().argmin())
                value.copy_(torch.where(kept.to(value.device), value, torch.full_like(value, zero)))
            elif _is_dtensor(value):
                _assign(value, whole * keep)
            else:  # a plain tensor: the whole value, or this rank's shard of a DTensor parameter's
                value.copy_(_local(whole * keep, param).to(value.device, value.dtype))
            zeros, total = zeros + int((~keep).sum()), total + keep.numel()
    return zeros, total


class ReLoRACallback(TrainerCallback):
    """Axolotl's ReLoRA restarts for a ``transformers.Trainer`` (under NDParallelCallback or alone): before the
    steps N, 2N, ... the prepared model (``trainer.model_wrapped``) is merged and re-initialised, and the
    Trainer's optimizer pruned. Logs ``num_lora_restarts`` as Axolotl does."""

    def __init__(self, trainer, restart_steps: int, prune_method: str | None = "magnitude",
                 ratio: float | None = None, cpu_offload: bool = False, master=None):
        self.trainer, self.every, self.cpu_offload = trainer, restart_steps, bool(cpu_offload)
        self.master = master  # a quantized base's float weights (relora_quantized.FloatMaster), else None
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
        layers = merge_and_reinit(model, args.seed, step, self.cpu_offload, self.master)
        zeros, total = prune_moments(model, self.trainer.optimizer, args.seed, step, self.method, self.ratio)
        self.restarts += 1
        if state.is_world_process_zero:
            print(f"[nd_parallel] relora: restart {self.restarts} at step {step}: {layers} LoRA layers merged and "
                  f"re-initialised; {zeros}/{total} adapter moment values pruned ({self.method})", flush=True)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            logs["num_lora_restarts"] = self.restarts
        return control
