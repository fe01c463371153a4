"""A tiny gpt-oss checkpoint in the MXFP4 form openai/gpt-oss-* ship (the tests' stand-in for them; no hub).

The format (OCP Microscaling, as transformers' ``integrations/mxfp4.py`` reads it): each expert weight is stored
transposed, ``[experts, out, in]``, and cut along ``in`` into blocks of 32 values. A block keeps one shared scale,
an E8M0 byte (``2 ** (byte - 127)``, ``<name>_scales``: ``[experts, out, in / 32]``), and 32 FP4 E2M1 codes, two to
a byte, the even element in the low nibble (``<name>_blocks``: ``[experts, out, in / 32, 16]``). A code is a sign
bit over the 8 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. The checkpoint's config.json says
``quantization_config: {quant_method: mxfp4}``; everything but the experts' two weight tensors stays as it was.

``to_fp4_grid`` puts a weight on that grid (what MXFP4 keeps of it); ``pack`` and ``unpack`` are exact inverses
for such weights, so a model whose expert weights were put on the grid is what a dequantizing load must return.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

BLOCK = 32  # values per shared scale (the MX formats' block size)
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1, codes 0..7; code | 8 is the negative value
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # gpt-oss' stacked expert weights stored in MXFP4 (biases are not)
# What openai/gpt-oss-* write next to quant_method (the modules kept in full precision).
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def _blocks_of(weight: torch.Tensor) -> torch.Tensor:
    """[experts, in, out] -> [experts, out, in / 32, 32] in float64 (exact for every scale and value here)."""
    experts, inner, outer = weight.shape
    if inner % BLOCK:
        raise ValueError(f"an MXFP4 expert weight needs its input size divisible by {BLOCK}, got {inner} "
                         f"(shape {tuple(weight.shape)}); pick hidden_size / intermediate_size multiples of {BLOCK}")
    return weight.detach().double().transpose(1, 2).reshape(experts, outer, inner // BLOCK, BLOCK)


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32]) of an expert weight [E, in, out]: the shared
    exponent is floor(log2(amax)) - 2 (the OCP choice: the block's largest value lands in [4, 8)), each value rounded
    to the nearest FP4 magnitude (ties to the smaller one), saturating at 6."""
    x = _blocks_of(weight)
    amax = x.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -200))) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    scaled = (x / torch.exp2(exp).unsqueeze(-1)).abs()
    grid = torch.tensor(MAGNITUDES, dtype=torch.float64)
    codes = (scaled.unsqueeze(-1) - grid).abs().argmin(dim=-1)  # first minimum: ties to the smaller magnitude
    codes = (codes | ((x < 0) & (codes > 0)).long() * 8).to(torch.uint8)  # the sign bit, no negative zero
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def unpack(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The expert weight [E, in, out] that ``blocks`` / ``scales`` hold (this format's definition, written apart from
    transformers' dequantizer so that the tests can hold one against the other)."""
    lut = torch.tensor(MAGNITUDES + tuple(-m for m in MAGNITUDES), dtype=torch.float64)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # low nibble first
    x = lut[codes] * torch.exp2(scales.double() - 127).unsqueeze(-1)
    experts, outer, groups, _ = x.shape
    return x.reshape(experts, outer, groups * BLOCK).transpose(1, 2).to(dtype).contiguous()


def to_fp4_grid(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as MXFP4 keeps it: each value on its block's FP4 grid (in ``weight``'s dtype)."""
    return unpack(*pack(weight), dtype=weight.dtype)


def expert_keys(names) -> list[str]:
    """The checkpoint keys that MXFP4 stores as blocks and scales."""
    return [k for k in names if ".mlp.experts." in k and k.rsplit(".", 1)[-1] in EXPERT_WEIGHTS]


def save_mxfp4_checkpoint(source: str | Path, target: str | Path) -> dict[str, torch.Tensor]:
    """Write ``source`` (a saved gpt-oss checkpoint, one safetensors file) to ``target`` in MXFP4 form: its expert
    weights as ``*_blocks`` / ``*_scales``, config.json with ``quantization_config: {quant_method: mxfp4}``, every
    other file copied. Returns the expert weights on the FP4 grid (what a dequantizing load must give back)."""
    import shutil

    from safetensors.torch import load_file, save_file

    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, target / file.name)
    files = sorted(source.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{source}: expected one model.safetensors, found {[f.name for f in files]}")
    tensors = load_file(str(files[0]))
    keys = expert_keys(tensors)
    if not keys:
        raise ValueError(f"{source} has no gpt-oss expert weights (*.mlp.experts.gate_up_proj / down_proj) to pack")
    on_grid = {}
    for key in keys:
        weight = tensors.pop(key)
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = pack(weight)
        on_grid[key] = unpack(tensors[f"{key}_blocks"], tensors[f"{key}_scales"], dtype=weight.dtype)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return on_grid
