"""Multimodal batches, built on each rank at collate time (Axolotl's MultiModalChatDataCollator): the rows' turns
rendered (mm_templates.py), their images loaded and resized, the processor run on the micro-batch (padding to its
longest row), and the labels masked (`mask_labels`).

A row is ``{"mm": JSON}`` with ``{"messages": [{"role", "content": [{"type": "text", "text"} | {"type": "image",
"path" | "base64"}]}]}``, as mm_rows.py wrote it in the parent. The data-parallel split stays the Trainer's split of
rows: each rank processes only its own.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass, field

import torch

from nd_parallel.distributed.loss import IGNORE_INDEX

from .mm_templates import (
    IMAGE_MARKS,
    IMAGES_FIRST,
    MEDIA_TOKENS,
    MISTRAL_COMMON,
    ROLE_MARKERS,
    flatten,
    keep_roles,
    override,
)
from .templates import MM_JINJA

SETTINGS_FILE = "nd_parallel_mm.json"


@dataclass
class MMSettings:
    """What the parent decided (saved beside the processor): how to render, resize and mask."""

    template: str | None = None
    """Jinja text to render with (None: the processor's own)."""
    name: str | None = None
    """The named template (flattened turns, its role markers and media tokens), or None."""
    image_size: int | list[int] | None = None
    resize: str = "bilinear"
    train_on_inputs: bool = False
    roles_to_train: list[str] = field(default_factory=lambda: ["assistant"])
    train_on_eos: str = "turn"
    date_string: str | None = None
    """Today's date as the parent read it, for the templates that write it (llama3_2_vision): every rank renders
    the same date, also across midnight."""
    role_boundaries_override: list[dict] | None = None
    """Axolotl's role_boundaries: markers that replace the template's (mm_templates.override)."""


def load_image(item: dict, settings: MMSettings):
    """A PIL RGB image from a normalised image item, resized as Axolotl's image_size says."""
    from PIL import Image, ImageOps

    source = item["path"] if "path" in item else io.BytesIO(base64.b64decode(item["base64"]))
    with Image.open(source) as opened:
        image = opened.convert("RGB")
    size, method = settings.image_size, getattr(Image.Resampling, settings.resize.upper())
    if isinstance(size, list):  # [width, height]: resized to it
        return image.resize(tuple(size), method)
    if isinstance(size, int):  # a square: aspect kept, black borders
        return ImageOps.pad(image, (size, size), method=method, color=(0, 0, 0))
    return image


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def mask_labels(input_ids: torch.Tensor, processor, settings: MMSettings) -> torch.Tensor:
    """Labels: input_ids with the untrained roles (a template with role markers, unless train_on_inputs), the
    padding and the media tokens set to -100 (Axolotl's process_labels)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    keep = torch.ones_like(input_ids, dtype=torch.bool)
    markers = override(settings.role_boundaries_override) if settings.role_boundaries_override else \
        ROLE_MARKERS.get(settings.name or "")
    if markers and not settings.train_on_inputs:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        bounds = [(b, _ids(tokenizer, b.start), eos if b.end == "{eos}" else _ids(tokenizer, b.end) if b.end else [])
                  for b in markers]
        keep = torch.tensor([keep_roles(row, bounds, settings) for row in input_ids.tolist()], dtype=torch.bool)
    dropped = {tokenizer.pad_token_id}
    for token in (getattr(processor, "image_token", None), *MEDIA_TOKENS.get(settings.name or "", ())):
        if token is not None and token in tokenizer.get_vocab():
            dropped.add(tokenizer.convert_tokens_to_ids(token))
    for token_id in dropped - {None}:
        keep &= input_ids != token_id
    return input_ids.masked_fill(~keep, IGNORE_INDEX)


@dataclass
class MultimodalCollator:
    processor: object
    settings: MMSettings

    def render(self, messages: list[dict]) -> str:
        s = self.settings
        if s.name is not None and s.name not in MM_JINJA:  # a named template: flattened turns, by our Jinja
            mark = IMAGE_MARKS.get(s.name) or getattr(self.processor, "image_token", None) or "<image>"
            turns = flatten(messages, mark, s.name in IMAGES_FIRST)
            return self.processor.tokenizer.apply_chat_template(turns, chat_template=s.template, tokenize=False)
        dated = {"date_string": s.date_string} if s.date_string else {}
        return self.processor.apply_chat_template(messages, chat_template=s.template, tokenize=False, **dated)

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if self.settings.name == MISTRAL_COMMON:  # mistral-common renders and encodes images itself
            from .mm_mistral import batch

            return batch(self.processor, [json.loads(r["mm"])["messages"] for r in rows], self.settings, load_image)
        texts, images = [], []
        for row in rows:
            messages = json.loads(row["mm"])["messages"]
            texts.append(self.render(messages))
            images.append([load_image(i, self.settings) for m in messages for i in m["content"]
                           if i["type"] == "image"])
        # As the processor's apply_chat_template tokenizes: a rendering that starts with the BOS gets no second one
        bos = self.processor.tokenizer.bos_token
        batch = self.processor(text=texts, images=images if any(images) else None, padding=True, return_tensors="pt",
                               add_special_tokens=not (bos is not None and texts[0].startswith(bos)))
        batch = dict(batch)
        batch["labels"] = mask_labels(batch["input_ids"], self.processor, self.settings)
        return batch
