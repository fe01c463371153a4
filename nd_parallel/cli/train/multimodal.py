"""Axolotl's multimodal (vision-language) keys for `nd-parallel train`: ``processor_type`` and what goes with it.

With a processor the run trains an image-text-to-text model (``AutoModelForImageTextToText``, or the class
``model_type`` names) on chat_template conversations whose turns hold images: the parent checks and normalises the
rows (data/mm_rows.py), and each rank renders, tokenizes and processes its own micro-batches at collate time with the
checkpoint's processor (data/mm_collate.py), masking labels as Axolotl's processing strategies do. Axolotl's meaning
(src/axolotl/utils/collators/mm_chat.py, processing_strategies.py); what does not fit a layout is refused here, in
the config stage, before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The model classes a multimodal YAML may name (Axolotl's model_type): the checkpoint's own class is loaded through
# AutoModelForImageTextToText, as AutoModelForCausalLM does for *ForCausalLM names.
AUTO_CLASSES = ("AutoModelForImageTextToText", "AutoModelForVision2Seq")
RESIZE = ("bilinear", "bicubic", "lanczos")
# Processors whose inputs are not images: their chat rendering and features are not implemented here.
AUDIO_PROCESSORS = ("VoxtralProcessor",)
# Axolotl's freeze_mm_modules: parameters with one of these path components belong to a vision/audio encoder.
MM_MODULES = ("vision_tower", "vision_model", "vision_encoder", "embed_vision", "multi_modal_projector", "visual",
              "audio_tower", "audio_model", "embed_audio")


def is_multimodal_class(name: Any) -> bool:
    return isinstance(name, str) and (name in AUTO_CLASSES or name.endswith("ForConditionalGeneration"))


def image_text_class(t) -> bool:
    """Whether the ranks load AutoModelForImageTextToText: with a processor, or an image-text ``model_type`` named
    without one (Axolotl's text-only run of such a class, e.g. Llama4ForConditionalGeneration: its vision tower sits
    unused, the language model trains on text rows as any causal LM)."""
    return bool(t.processor_type) or is_multimodal_class(t.model_type)


@dataclass(kw_only=True)
class MultimodalOptions:
    processor_type: str | None = None
    """Axolotl's processor class (AutoProcessor, or a *Processor name): the checkpoint's processor is loaded with
    AutoProcessor and the model with AutoModelForImageTextToText. Default none (a text model)."""
    processor_kwargs: dict | None = None
    """Passed to AutoProcessor.from_pretrained (e.g. {min_pixels: ..., max_pixels: ...})."""
    image_size: int | list[int] | None = None
    """Resize every image before the processor: an integer pads to a square of that side (aspect kept, black
    borders), [width, height] resizes to it (Axolotl's meaning). Default: as read."""
    image_resize_algorithm: str | None = None
    """bilinear (default), bicubic or lanczos."""
    freeze_mm_modules: bool = False
    """Freeze the vision/audio encoder and projector (parameters under MM_MODULES), train the language model."""
    remove_unused_columns: bool | None = None
    """Accepted: the rows' columns always reach the collator here (Axolotl's examples set false for that)."""
    role_boundaries: list | None = None
    """[{role, start, end, include_start, include_end}]: the role markers the labels are masked by, replacing the
    chat template's (end: eos_token, or null for the end of the row), Axolotl's meaning."""


def _boundary_refusals(specs) -> list[str]:
    keys = {"role", "start", "end", "include_start", "include_end"}
    if specs is None or specs == []:
        return []
    good = isinstance(specs, list) and all(
        isinstance(b, dict) and set(b) <= keys and isinstance(b.get("role"), str) and isinstance(b.get("start"), str)
        and b["start"] and (b.get("end") is None or isinstance(b["end"], str))
        and all(isinstance(b.get(k, False), bool) for k in ("include_start", "include_end")) for b in specs)
    return [] if good else [f"role_boundaries={specs!r}: write a list of {{role, start, end, include_start, "
                            "include_end}} (start a non-empty string; end a string, eos_token, or null)"]


def multimodal_refusals(d: dict, layout) -> list[str]:
    """The multimodal keys' refusals, each with its fix (the config stage's one message)."""
    processor, out = d.get("processor_type"), _boundary_refusals(d.get("role_boundaries"))
    if not processor:
        for key in ("image_size", "image_resize_algorithm", "freeze_mm_modules", "processor_kwargs",
                    "role_boundaries"):
            if d.get(key):
                out.append(f"{key}={d[key]!r} without processor_type: it shapes multimodal training only; set "
                           "processor_type: AutoProcessor (a vision-language checkpoint) or drop it")
        split = {k: getattr(layout, k) for k in ("pp_size", "cp_size", "ep_size") if getattr(layout, k, 1) > 1}
        if is_multimodal_class(d.get("model_type")) and split:  # Axolotl's text-only run of an image-text class
            out.append(f"model_type={d['model_type']!r} (an image-text class, trained on text) with "
                       f"{', '.join(f'{k}={v}' for k, v in split.items())}: the outer model's forward is neither cut "
                       "into stages nor sequence-sharded here; use dp_shard_size / dp_replicate_size / "
                       "tensor_parallel_size, or the text model's *ForCausalLM class")
        return out
    if not isinstance(processor, str) or not (processor == "AutoProcessor" or processor.endswith("Processor")):
        out.append(f"processor_type={processor!r}: write AutoProcessor (or the checkpoint's *Processor class)")
    elif processor in AUDIO_PROCESSORS:
        out.append(f"processor_type={processor!r}: audio inputs are not implemented (its chat rendering goes through "
                   "mistral-common and audio features); train a vision-language model, or run the YAML with Axolotl")
    out += _layout_refusals(d, layout)
    if d.get("sample_packing"):
        out.append("sample_packing=True with processor_type: packing multimodal rows is not supported (Axolotl refuses "
                   "it too: its image features follow each row's own tokens); set sample_packing: false")
    if d.get("rl"):
        out.append(f"rl={d['rl']!r} with processor_type: preference training of vision-language models is not "
                   "implemented; drop rl (supervised fine-tuning) or processor_type")
    size = d.get("image_size")
    if size is not None and not (_positive_int(size) or (isinstance(size, list) and len(size) == 2
                                                        and all(map(_positive_int, size)))):
        out.append(f"image_size={size!r}: write an integer (a padded square) or [width, height]")
    if d.get("image_resize_algorithm") not in (None, *RESIZE):
        out.append(f"image_resize_algorithm={d['image_resize_algorithm']!r}: use one of {', '.join(RESIZE)}")
    for i, entry in enumerate(d.get("datasets") or []):
        kind = entry.get("type", "completion") if isinstance(entry, dict) else None
        if isinstance(entry, dict) and kind not in ("chat_template", "chat_template.default"):
            out.append(f"datasets[{i}].type={kind!r} with processor_type: multimodal rows are conversations; use "
                       "type: chat_template (turns with {type: image, path: ...} / {type: text, text: ...} items, or "
                       "an images column)")
    return out


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _layout_refusals(d: dict, layout) -> list[str]:
    """Layouts that cannot carry image features (see docs/axolotl.md, "Multimodal")."""
    if layout is None:
        return []
    out = []
    if layout.pp_size > 1:
        out.append(f"pipeline_parallel_size={layout.pp_size} with processor_type: the vision tower and the merge of "
                   "its features into the token embeddings run in the outer model's forward, before the decoder "
                   "stack the stages cut; use dp_shard_size / dp_replicate_size / tensor_parallel_size")
    if layout.cp_size > 1:
        out.append(f"context_parallel_size={layout.cp_size} with processor_type: a sequence shard holds only part of "
                   "an image's placeholder tokens, so the model cannot place the image's features (and Qwen-VL's 3-D "
                   "positions are computed from the whole sequence); use dp_shard_size / tensor_parallel_size")
    if layout.ep_size > 1:
        out.append(f"expert_parallel_size={layout.ep_size} with processor_type: not checked with vision-language "
                   "models; use dp_shard_size / tensor_parallel_size")
    return out
