"""ReLoRA on a quantized base (QLoRA's NF4, LoRA on LLM.int8), with Axolotl 0.19's meaning: a restart merges each
LoRA delta into the layer's *float* weight, not into its quantized codes, and quantizes the sum again.

A 4-/8-bit weight cannot hold a small delta: merged into the dequantized codes (peft's merge of a 4-bit layer), a
delta far below the level spacing (NF4: ~1/8 of a 64-value block's absmax) is rounded away but for the values near a
level boundary, and each restart would add that rounding again. So, as Axolotl does, the float weights are kept
beside the run (its ``last_full_model``): at the first restart they are read from the base checkpoint, then from the
previous restart's copy; the restart computes ``float + B @ A x scaling``, quantizes it into the layer (bitsandbytes,
with the layer's own settings) and keeps the sum, in fp16 as Axolotl keeps it, for the next restart. A run ends by
writing the merged float model (Axolotl's ``merge_and_save``): the base checkpoint's tensors with the merged ones in
their place, file by file.

Where the float copies live: ``output_dir/relora_base/step-<S>/rank-<R>.safetensors``, one set per restart step S.
Every rank that holds a quantized LoRA layer merges it (the quantized base is replicated under FSDP2 / HSDP / DDP /
CP and split by stage under PP); the lowest rank holding a layer writes its copy, the others read it there. Written
by hand: Axolotl does this with its own ReLoRA callback, and peft's merge of a 4-bit layer re-quantizes the
dequantized codes (the rounding this avoids).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

MASTER_DIR = "relora_base"


def quantized_weight(layer) -> torch.Tensor | None:
    """The base layer's bitsandbytes weight (Params4bit / Int8Params), or None for a float layer."""
    weight = layer.get_base_layer().weight
    return weight if type(weight).__module__.startswith("bitsandbytes") else None


def requantize(layer, value: torch.Tensor) -> None:
    """The base layer's quantized weight made again from the float ``value``, with its own settings."""
    import bitsandbytes as bnb

    base = layer.get_base_layer()
    old = base.weight
    if isinstance(old, bnb.nn.Params4bit):
        fresh = bnb.nn.Params4bit(value.to("cpu", torch.float32).contiguous(), requires_grad=False,
                                  blocksize=old.blocksize, compress_statistics=old.compress_statistics,
                                  quant_type=old.quant_type, quant_storage=old.quant_storage, module=base)
    else:
        fresh = bnb.nn.Int8Params(value.to("cpu", torch.float16).contiguous(), requires_grad=False,
                                  has_fp16_weights=False)
    base.weight = fresh.to(old.device)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


class FloatMaster:
    """The float weights of this rank's quantized LoRA layers, by checkpoint key (see the module docstring)."""

    def __init__(self, source: str, output_dir: str):
        from nd_parallel.models.checkpoint_files import read_headers

        if not os.path.isdir(source):  # a hub id: the snapshot the model was loaded from
            from huggingface_hub import snapshot_download

            source = snapshot_download(source, local_files_only=True)
        self.source, self.root = str(source), Path(output_dir) / MASTER_DIR
        self.headers = read_headers(self.source)

    def previous(self, step: int) -> Path | None:
        """The folder of the latest complete restart before ``step`` (None: read the base checkpoint)."""
        steps = sorted(int(p.name.split("-")[1]) for p in self.root.glob("step-*") if (p / "done.json").is_file())
        older = [s for s in steps if s < step]
        return self.root / f"step-{older[-1]}" if older else None

    def read(self, keys: list[str], step: int) -> dict[str, torch.Tensor]:
        """The float weights of ``keys`` as the latest restart before ``step`` left them (else the checkpoint's)."""
        from safetensors import safe_open

        missing = [k for k in keys if k not in self.headers.files]
        if missing:
            raise KeyError(f"relora on a quantized base reads each merged layer's float weight from {self.source}; "
                           f"{missing[0]!r} is not in that checkpoint (a renamed or fused weight): use adapter: lora "
                           "on an unquantized base for this model")
        folder, out = self.previous(step), {}
        writers = json.loads((folder / "done.json").read_text())["writers"] if folder else {}
        for key in keys:
            path = folder / f"rank-{writers[key]}.safetensors" if key in writers else self.headers.files[key]
            with safe_open(str(path), framework="pt", device="cpu") as f:
                out[key] = f.get_tensor(key).float()
        return out

    def write(self, values: dict[str, torch.Tensor], step: int) -> None:
        """Each key's new float weight, written by the lowest rank holding it (fp16, as Axolotl keeps it); returns
        when every rank's are on disk. Every rank calls it."""
        import torch.distributed as dist
        from safetensors.torch import save_file

        rank, world = _rank_world()
        held = [list(values)]
        if world > 1:
            held = [None] * world
            dist.all_gather_object(held, list(values))  # also: every rank has read the previous copies
        writers = {}
        for r, names in enumerate(held):
            for key in names:
                writers.setdefault(key, r)
        mine = {k: v.to("cpu", torch.float16).contiguous() for k, v in values.items() if writers[k] == rank}
        folder = self.root / f"step-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        if mine:
            save_file(mine, str(folder / f"rank-{rank}.safetensors.tmp"), metadata={"format": "pt"})
            os.replace(folder / f"rank-{rank}.safetensors.tmp", folder / f"rank-{rank}.safetensors")
        _barrier()
        if rank == 0:  # last: a folder without it is never read
            (folder / "done.json").write_text(json.dumps({"writers": writers}))
        _barrier()


def save_merged(master: FloatMaster, step: int, config, output_dir: str) -> None:
    """Rank 0 writes the merged float model: each file of the base checkpoint with the merged tensors of restart
    folder ``step`` in place (fp16, as Axolotl writes them), the index, and the config without its quantization."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from nd_parallel.models.checkpoint_files import INDEX_NAME

    rank, _ = _rank_world()
    if rank != 0:
        return
    folder, out = master.root / f"step-{step}", Path(output_dir)
    writers = json.loads((folder / "done.json").read_text())["writers"]
    merged = {k: str(folder / f"rank-{r}.safetensors") for k, r in writers.items()}
    for file in sorted(set(master.headers.files.values())):
        tensors = {}
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key in merged:
                    with safe_open(merged[key], framework="pt", device="cpu") as g:
                        tensors[key] = g.get_tensor(key)
                else:
                    tensors[key] = f.get_tensor(key)
        save_file(tensors, str(out / Path(file).name), metadata={"format": "pt"})
    index = Path(master.source) / INDEX_NAME
    if index.is_file():
        (out / INDEX_NAME).write_text(index.read_text())
    plain = config.__class__.from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    plain.save_pretrained(str(out))
