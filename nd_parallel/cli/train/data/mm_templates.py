"""How a multimodal conversation is rendered and which of its tokens train, per Axolotl chat_template name.

Rendering: each turn's content items are flattened into one string, an image item becoming the family's
placeholder (``IMAGE_MARKS``; the processor expands it into the image's tokens), and the text templates of
templates.py render the turns, the vision-only ones included (templates.MM_FORMATS: llava, with a turn's images
before its text, and qwen2_vl). ``tokenizer_default`` keeps the processor's own template, which reads the items itself.

Labels (Axolotl's processing strategies): a template named in ``ROLE_MARKERS`` masks every token outside the turns of
roles_to_train (its role boundaries: start marker, end marker, whether the end marker trains); every other template
(llava, tokenizer_default, ...) masks only padding and media tokens, as Axolotl's base strategy does. Padding and the
media placeholders (``MEDIA_TOKENS``, plus the processor's image_token) never train.
"""

from __future__ import annotations

from dataclasses import dataclass

from .templates import FORMATS, MM_FORMATS, MM_JINJA, jinja

_QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGES_FIRST = ("llava",)
# MMSettings.name of a run whose processor is mistral-common's tokenizer (mm_mistral.py): it renders and encodes
# images itself, with no template of ours.
MISTRAL_COMMON = "mistral_common"
IMAGE_MARKS = {"llava": "<image>\n", "qwen2_vl": _QWEN_IMAGE, "qwen3_5": _QWEN_IMAGE, "gemma3": "<start_of_image>",
               "gemma3n": "<image_soft_token>", "gemma4": "<|image|>", "gemma4_unified": "<|image|>",
               "llama4": "<|image|>", "llama3_2_vision": "<|image|>", "pixtral": "[IMG]"}


@dataclass(frozen=True)
class Boundary:
    role: str
    start: str
    end: str
    """"{eos}": the tokenizer's eos_token."""
    include_end: bool = True
    """False: the end marker is the next turn's start (Pixtral's [/INST]), never trained with this turn."""
    include_start: bool = False
    """True: a trained turn's start marker is trained too (Axolotl's role_boundaries option)."""


def _turns(roles, start: str, end: str) -> list[Boundary]:
    return [Boundary(external, start.format(role=written), end) for external, written in roles]


_CHATML = _turns([(r, r) for r in ("system", "user", "assistant")], "<|im_start|>{role}\n", "<|im_end|>")
_GEMMA = _turns([("assistant", "model"), ("user", "user")], "<start_of_turn>{role}\n", "<end_of_turn>")
_HEADERS = [(r, r) for r in ("system", "user", "assistant", "ipython", "tool")]
ROLE_MARKERS = {
    "qwen2_vl": _CHATML, "qwen3_5": _CHATML, "gemma3": _GEMMA, "gemma3n": _GEMMA,
    "gemma4": _turns([("assistant", "model"), ("user", "user"), ("system", "system")], "<|turn>{role}\n", "<turn|>"),
    "llama3_2_vision": _turns(_HEADERS, "<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>"),
    "llama4": _turns(_HEADERS, "<|header_start|>{role}<|header_end|>\n\n", "<|eot|>"),
    "pixtral": [Boundary("user", "[INST]", "[/INST]", include_end=False), Boundary("assistant", "[/INST]", "{eos}")],
}
ROLE_MARKERS["gemma4_unified"] = ROLE_MARKERS["gemma4"]
# Media tokens besides the processor's image_token that never train (Axolotl's per-family process_labels).
MEDIA_TOKENS = {"qwen3_5": ("<|video_pad|>",), "gemma3": ("<start_of_image>", "<image_soft_token>"),
                "gemma3n": ("<image_soft_token>", "<audio_soft_token>", "<start_of_image>", "<end_of_image>"),
                "gemma4": ("<|image|>", "<|audio|>", "<|video|>")}


def override(specs: list[dict]) -> list[Boundary]:
    """Axolotl's role_boundaries (replacing a template's markers wholesale): end "eos_token" is the tokenizer's EOS,
    end null runs to the end of the sequence."""
    return [Boundary(s["role"], s["start"], "{eos}" if s.get("end") == "eos_token" else s.get("end") or "",
                     include_end=s.get("include_end", True), include_start=s.get("include_start", False))
            for s in specs]


def template_for(name: str | None, inline: str | None, tokenizer) -> tuple[str | None, str | None]:
    """(Jinja text or None for the processor's own, the named template or None) for Axolotl's chat_template keys,
    as templates.resolve_template decides them. Only a named template gets flattened turns (``flatten``): the
    processor's own template and a ``jinja`` one read the content items themselves."""
    if name is None and inline:
        name = "jinja"
    if name == "jinja":
        from .templates import resolve_template

        return resolve_template(name, inline, tokenizer), None
    if name in (None, "tokenizer_default"):
        return None, None
    if name.startswith("tokenizer_default_fallback_"):
        if getattr(tokenizer, "chat_template", None):
            return None, None
        name = name.removeprefix("tokenizer_default_fallback_")
    if name in MM_JINJA:  # it reads the content items itself (MultimodalCollator.render hands them over)
        return MM_JINJA[name], name
    return jinja(MM_FORMATS.get(name) or FORMATS[name]), name


def flatten(messages: list[dict], mark: str, images_first: bool) -> list[dict]:
    """Turns with string content: each image item replaced by ``mark``, in place, or (llava) all of a turn's images
    first and then its texts, a space apart (Axolotl's llava.jinja)."""
    out = []
    for m in messages:
        items = m["content"]
        if images_first:
            text = "".join(mark for i in items if i["type"] == "image") + " ".join(
                i.get("text", "") for i in items if i["type"] == "text")
        else:
            text = "".join(mark if i["type"] == "image" else i.get("text", "") for i in items)
        out.append({"role": m["role"], "content": text})
    return out


def keep_roles(ids: list[int], bounds: list[tuple[Boundary, list[int], list[int]]], settings) -> list[bool]:
    """Axolotl's role scan: left to right, the longest start marker wins; a trained role's content (and its end
    marker, per train_on_eos: turn / all / none / last) is kept; an end marker that is not included is handed back
    as the next turn's start."""
    keep, n, j, last = [False] * len(ids), len(ids), 0, None
    roles, eos = set(settings.roles_to_train), settings.train_on_eos
    while j < n:
        found = [b for b in bounds if b[1] and ids[j:j + len(b[1])] == b[1]]
        if not found:
            j += 1
            continue
        b, start, end = max(found, key=lambda x: len(x[1]))
        content, stop, closed = j + len(start), n, False
        for k in range(content, n - len(end) + 1 if end else content):
            if ids[k:k + len(end)] == end:
                stop, closed = k, True
                break
        after = stop + len(end) if closed else n
        if b.role in roles:
            keep[j if b.include_start else content:stop] = [True] * (stop - (j if b.include_start else content))
            if closed and b.include_end and eos in ("turn", "all"):
                keep[stop:after] = [True] * (after - stop)
            if closed and b.include_end and eos == "last":
                last = (stop, after)
        elif closed and b.include_end and eos == "all":
            keep[stop:after] = [True] * (after - stop)
        j = stop if closed and not b.include_end else after
    if last is not None:
        keep[last[0]:last[1]] = [True] * (last[1] - last[0])
    return keep
