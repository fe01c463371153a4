"""Vision-language rows through mistral-common: `processor_type` with `tokenizer_use_mistral_common: true` (Axolotl's
Mistral3Processor: Mistral Small 3.x / Magistral / Ministral vision checkpoints, which ship mistral-common's
tekken.json with an image section).

mistral-common renders the conversation and encodes its images itself: each image is scaled to its patch grid
(``image_patch_size`` x ``spatial_merge_size``, at most ``max_image_size``), normalised, and written as rows of
[IMG] tokens closed by [IMG_BREAK] / [IMG_END]. Each rank encodes its own micro-batch at collate time through
transformers' MistralCommonBackend (fine-tuning mode), as Axolotl's processor does; images of one micro-batch are
zero-padded to the largest (bottom / right) with their true ``image_sizes``, as the Pixtral image processor pads
(the vision tower crops each image back to its size). ``image_size`` / ``image_resize_algorithm`` resize an image
before mistral-common sees it, as for the other processors.

Labels: the tokens of the turns of roles_to_train, found by mistral-common's control tokens ([INST] ... [/INST] a
user turn, [/INST] ... </s> an assistant turn, [SYSTEM_PROMPT] ... [/SYSTEM_PROMPT] a system prompt), with the </s>
that ends a trained assistant turn per train_on_eos, as mistral-common's text path (data/mistral.py) trains them;
padding and the image tokens never train. Axolotl 0.19's Mistral3 strategy declares no role boundaries and so
trains every non-image token (it warns that roles_to_train is not applied there); here the key keeps its meaning.

The parent checks every conversation before any rank starts (mistral-common's validator on the text, each image
counted as a text stand-in), so a malformed record stops the run there, naming it.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import torch

from nd_parallel.config import ConfigError
from nd_parallel.distributed.loss import IGNORE_INDEX

from . import mistral
from .mm_templates import MISTRAL_COMMON, Boundary, keep_roles

NAME = MISTRAL_COMMON  # MMSettings.name of such a run
IMAGE_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
_MARKERS = [(Boundary("user", "[INST]", "[/INST]", include_end=False), "[INST]", "[/INST]"),
            (Boundary("assistant", "[/INST]", "{eos}"), "[/INST]", None),
            (Boundary("system", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"), "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")]


def load(folder: str | Path):
    """The checkpoint's mistral-common tokenizer, refused before any rank starts where it cannot encode images."""
    tokenizer, how = mistral.load_tokenizer(folder)
    if getattr(tokenizer.tokenizer.instruct_tokenizer, "image_encoder", None) is None:
        raise ConfigError(f"processor_type with {mistral.KEY}: the mistral-common tokenizer of {folder} has no image "
                          "section (tekken.json 'image' / 'multimodal'), so it cannot encode images; point "
                          "tokenizer_config at the vision checkpoint's tekken.json, or drop "
                          f"{mistral.KEY} to use the checkpoint's Hugging Face processor")
    import importlib.util

    if importlib.util.find_spec("cv2") is None:
        raise ConfigError(f"processor_type with {mistral.KEY}: mistral-common resizes images with OpenCV, which is "
                          "not installed; pip install 'nd_parallel[mistral]' (or 'mistral-common[opencv]')")
    return tokenizer, how


def _png(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # lossless: mistral-common decodes the same pixels
    return base64.b64encode(buffer.getvalue()).decode()


def _text(content: list[dict]) -> str:
    return "".join(i["text"] for i in content if i["type"] == "text")


def request(messages: list[dict], image) -> list[dict]:
    """A normalised conversation (mm_rows) in the form MistralCommonBackend.apply_chat_template reads; ``image`` maps
    an image item to its content item."""
    out = []
    for m in messages:
        if m["role"] == "user":
            out.append({"role": "user", "content": [image(i) if i["type"] == "image" else
                                                    {"type": "text", "text": i["text"]} for i in m["content"]]})
        else:  # images only in user turns (check_rows)
            out.append({"role": m["role"], "content": _text(m["content"])})
    return out


def check_rows(tokenizer, rows, where: str) -> None:
    """Every conversation through mistral-common's validator (images as a text stand-in): before any rank starts."""
    import json

    for i, row in enumerate(rows["mm"]):
        messages = json.loads(row)["messages"]
        odd = next((m["role"] for m in messages if m["role"] != "user"
                    and any(c["type"] == "image" for c in m["content"])), None)
        if odd is not None:
            raise ConfigError(f"{where}, conversation {i}: an image in a {odd!r} turn; mistral-common reads images in "
                              "user turns only: move it to the user turn before")
        mistral._encode(tokenizer, request(messages, lambda item: {"type": "text", "text": "[image]"}),
                        where, i)


def _bounds(tokenizer) -> list[tuple[Boundary, list[int], list[int]]]:
    ids = tokenizer.convert_tokens_to_ids
    return [(b, [ids(start)], [tokenizer.eos_token_id] if end is None else [ids(end)]) for b, start, end in _MARKERS]


def batch(tokenizer, conversations: list[list[dict]], settings, load_image) -> dict[str, torch.Tensor]:
    """One micro-batch: ids padded to the longest row, images zero-padded to the largest, labels masked."""
    ids, images, sizes = [], [], []
    for messages in conversations:
        def image(item):
            return {"type": "image", "base64": _png(load_image(item, settings))}

        out = tokenizer.apply_chat_template(request(messages, image), tokenize=True, return_dict=True)
        ids.append(list(out["input_ids"]))
        for pixels in out.get("pixel_values") or []:
            images.append(torch.as_tensor(pixels, dtype=torch.float32))  # mistral-common's arrays are float64
            sizes.append(list(images[-1].shape[-2:]))
    longest, pad = max(map(len, ids)), tokenizer.pad_token_id
    input_ids = torch.tensor([row + [pad] * (longest - len(row)) for row in ids])
    attention = torch.tensor([[1] * len(row) + [0] * (longest - len(row)) for row in ids])
    keep = torch.ones_like(input_ids, dtype=torch.bool)
    if not settings.train_on_inputs:
        bounds = _bounds(tokenizer)
        keep = torch.tensor([keep_roles(row, bounds, settings) for row in input_ids.tolist()], dtype=torch.bool)
    keep &= attention.bool()
    for token in IMAGE_TOKENS:
        keep &= input_ids != tokenizer.convert_tokens_to_ids(token)
    result = {"input_ids": input_ids, "attention_mask": attention, "labels": input_ids.masked_fill(~keep, IGNORE_INDEX)}
    if images:
        height, width = max(s[0] for s in sizes), max(s[1] for s in sizes)
        padded = images[0].new_zeros(len(images), images[0].shape[0], height, width)
        for k, pixels in enumerate(images):
            padded[k, :, :pixels.shape[-2], :pixels.shape[-1]] = pixels
        result["pixel_values"], result["image_sizes"] = padded, torch.tensor(sizes)
    return result
