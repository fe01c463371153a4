"""Multimodal rows, checked and normalised in the parent (processor_type); the ranks process them (mm_collate.py).

Each record's turns (``field_messages``, else Axolotl's legacy ``conversations`` of from/value) become
``{"role", "content": [items]}`` with the roles mapped (data/sources.py's role names), string content as one text
item, and every image item reduced to a local ``path`` (absolute: relative paths start at the working directory, as
Axolotl's load_image reads them) or ``base64`` bytes. Images given as ``{"type": "image", "path" | "base64" | "url" |
"image": ...}``, or in an ``images`` (``image``) column: as in Axolotl its first image fills the first bare
``{"type": "image"}`` item, else joins the first user turn. Nothing is downloaded: an http(s) URL is refused.
Rows are stored as JSON strings (column ``mm``), so every rank reads exactly the normalised turns.
"""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path

from nd_parallel.config import ConfigError

from .mm_templates import MISTRAL_COMMON
from .sources import DatasetSpec, load_source
from .templates import MM_JINJA

IMAGE_KEYS = ("path", "url", "base64", "image")


def _image(value, where: str) -> dict:
    """An image value (path, file:// or data: URI, base64 text, bytes, a datasets Image dict, a PIL image) as
    {"path": abs} or {"base64": text}."""
    if hasattr(value, "save"):  # a PIL image (a datasets Image column)
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return {"base64": base64.b64encode(buffer.getvalue()).decode()}
    if isinstance(value, dict):  # datasets' Image feature undecoded: {"bytes", "path"}
        if value.get("bytes"):
            return {"base64": base64.b64encode(value["bytes"]).decode()}
        return _image(value.get("path"), where)
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode()}
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: image {value!r} is not a path, URL or base64 text")
    if value.startswith(("http://", "https://")):
        raise ConfigError(f"{where}: image {value[:80]!r} is a URL; nd-parallel train downloads nothing: save the "
                          "image and give its path ({type: image, path: FILE})")
    if value.startswith("data:"):
        return {"base64": value.split(",", 1)[-1]}
    path = Path(value.removeprefix("file://")).expanduser()
    if path.is_file():
        return {"path": str(path.resolve())}
    if len(value) > 256 or not any(c in value for c in "/.\\"):  # no file of that name: base64 text
        try:
            base64.b64decode(value, validate=True)
            return {"base64": value}
        except ValueError:
            pass
    raise ConfigError(f"{where}: image file {value!r} not found (relative paths start at the working directory "
                      f"{os.getcwd()}); fix the path")


def _content(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ConfigError(f"{where}: content {content!r} is neither text nor a list of {{type: ...}} items")
    items = []
    for item in content:
        item = {k: v for k, v in item.items() if v is not None} if isinstance(item, dict) else item
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            items.append({"type": "text", "text": item.get("text", "")})
        elif kind == "image":
            source = next((k for k in IMAGE_KEYS if k in item), None)
            items.append({"type": "image", **(_image(item[source], where) if source else {})})
        else:
            raise ConfigError(f"{where}: content item {str(item)[:80]}: only text and image items are implemented "
                              "(audio and video are not); use {type: text, text: ...} or {type: image, path: ...}")
    return items


def normalise(record: dict, spec: DatasetSpec, where: str) -> dict:
    """One record's turns, normalised (see the module docstring)."""
    turns, role_key, content_key = record.get(spec.field_messages), spec.role_key, spec.content_key
    if turns is None and record.get("conversations") is not None:  # Axolotl's legacy ShareGPT turns
        turns, role_key, content_key = record["conversations"], "from", "value"
    if not isinstance(turns, list) or not turns:
        raise ConfigError(f"{where}: no turns in {spec.field_messages!r} (or 'conversations'); set field_messages")
    roles = spec.role_map
    messages = [{"role": roles.get(t.get(role_key), t.get(role_key)), "content": _content(t.get(content_key), where)}
                for t in turns]
    if spec.drop_system_message and messages[0]["role"] == "system":
        messages = messages[1:]
    column = next((record[k] for k in ("images", "image") if record.get(k) is not None), None)
    if column is not None:
        first = column[0] if isinstance(column, list) else column  # Axolotl uses the first image of the column
        bare = [i for m in messages for i in m["content"] if i["type"] == "image" and len(i) == 1]
        if bare:
            bare[0].update(_image(first, where))
        else:
            user = next((m for m in messages if m["role"] == "user"), messages[0])
            user["content"].append({"type": "image", **_image(first, where)})
    if any(i["type"] == "image" and len(i) == 1 for m in messages for i in m["content"]):
        raise ConfigError(f"{where}: an {{type: image}} item has no image (no path/base64/url/image key and no "
                          "images column to fill it); give each image item its file")
    return {"messages": messages}


def multimodal_rows(spec: DatasetSpec, cache: str):
    """(datasets.Dataset of {"mm": JSON}, the source's report line)."""
    import datasets

    raw, where = load_source(spec, cache)
    rows = [{"mm": json.dumps(normalise(record, spec, f"{where}, record {i}"))} for i, record in enumerate(raw)]
    if not rows:
        raise ConfigError(f"{where}: no records; add data or remove this entry")
    images = sum(r["mm"].count('"type": "image"') for r in rows)
    return datasets.Dataset.from_list(rows), f"{where}: {len(rows)} conversations, {images} images"


def load_processor(cfg):
    """The checkpoint's processor (tokenizer_config's, else base_model's) with the YAML's tokens applied."""
    from transformers import AutoProcessor

    source = cfg.tokenizer_config or cfg.base_model
    extra = {} if cfg.trust_remote_code is None else {"trust_remote_code": cfg.trust_remote_code}
    try:
        processor = AutoProcessor.from_pretrained(source, **extra, **(cfg.processor_kwargs or {}))
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"processor_type={cfg.processor_type!r}: cannot load a processor from {source}: {err}; "
                          "point base_model (or tokenizer_config) at a checkpoint with its processor files") from None
    if not hasattr(processor, "tokenizer") or not hasattr(processor, "image_processor"):
        raise ConfigError(f"{source}: {type(processor).__name__} is not an image-text processor (it has no tokenizer "
                          "and image_processor); processor_type needs a vision-language checkpoint")
    tokenizer = processor.tokenizer
    if cfg.special_tokens:
        tokenizer.add_special_tokens(dict(cfg.special_tokens))
    if cfg.tokens:
        tokenizer.add_tokens(list(cfg.tokens))
    if tokenizer.pad_token is None:  # as load_tokenizer: padding never trains, so EOS may stand in
        tokenizer.pad_token = tokenizer.eos_token
    return processor


def prepare_multimodal(cfg, workdir, split, dp: int = 1) -> tuple:
    """data.prepare for processor_type: rows normalised, checked (`check_imageless`), mixed, split (``split``:
    data._split); the processor and the collator's settings saved beside them (no tokenizing here: the ranks process
    their own rows). Returns data.Prepared's fields."""
    import datasets

    from .mm_collate import SETTINGS_FILE, MMSettings
    from .mm_templates import template_for

    if cfg.tokenizer_use_mistral_common:  # mistral-common's tokenizer is the processor (mm_mistral.py)
        from . import mm_mistral

        processor = mm_mistral.load(cfg.tokenizer_config or cfg.base_model)[0]
        template, name = None, MISTRAL_COMMON
    else:
        processor = load_processor(cfg)
        template, name = template_for(cfg.chat_template, cfg.chat_template_jinja, processor.tokenizer)
    if name is None and template is None and not getattr(processor, "chat_template", None):
        raise ConfigError(f"chat_template={cfg.chat_template!r}: the processor of {cfg.base_model} has no chat "
                          "template; name one (e.g. chat_template: chatml, llava, qwen2_vl, gemma3)")
    first = cfg.datasets[0]  # Axolotl's strategy reads the first entry's roles_to_train / train_on_eos
    settings = MMSettings(template=template, name=name, image_size=cfg.image_size,
                          resize=cfg.image_resize_algorithm or "bilinear", train_on_inputs=cfg.train_on_inputs,
                          roles_to_train=list(first.roles_to_train), train_on_eos=first.train_on_eos or "turn",
                          date_string=_today() if name in MM_JINJA else None,
                          role_boundaries_override=cfg.role_boundaries or None)
    parts, lines = [], []
    for spec in cfg.datasets:
        ds, line = multimodal_rows(spec, str(Path(workdir) / "raw-cache"))
        parts.append(ds)
        lines.append(line)
    merged = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    check_imageless(cfg, merged, dp)
    if name == MISTRAL_COMMON:
        from .mm_mistral import check_rows

        check_rows(processor, merged, ", ".join(lines))
    else:
        check_rendering(processor, settings, merged)
    if cfg.shuffle_merged_datasets and len(parts) > 1:
        merged = merged.shuffle(seed=cfg.seed)
    train, evals = split(merged, cfg)
    out = Path(workdir) / "prepared-multimodal"
    train.save_to_disk(str(out / "train"))
    if evals is not None:
        evals.save_to_disk(str(out / "eval"))
    processor.save_pretrained(str(out / "processor"))
    (processor if name == MISTRAL_COMMON else processor.tokenizer).save_pretrained(str(out / "tokenizer"))
    (out / "processor" / SETTINGS_FILE).write_text(json.dumps(settings.__dict__))
    how = f"processor {type(processor).__name__} of {cfg.tokenizer_config or cfg.base_model}, template " + (
        "mistral-common's" if name == MISTRAL_COMMON else name or (
            "chat_template_jinja" if template else "the processor's own"))
    return str(out), how, lines, len(train), len(evals) if evals is not None else 0


def _today() -> str:
    """Today's date as transformers' strftime_now writes it in Llama 3.2 Vision's template ("04 Dec 2026")."""
    import datetime

    return datetime.datetime.now().strftime("%d %b %Y")


def load_prepared_processor(path: str, trust_remote_code: bool | None = None):
    """(processor, MMSettings) that prepare_multimodal saved: what each rank reads."""
    from transformers import AutoProcessor

    from .mm_collate import SETTINGS_FILE, MMSettings

    root = Path(path) / "processor"
    settings = MMSettings(**json.loads((root / SETTINGS_FILE).read_text()))
    if settings.name == MISTRAL_COMMON:
        from .mistral import load_tokenizer

        return load_tokenizer(root)[0], settings
    extra = {} if trust_remote_code is None else {"trust_remote_code": trust_remote_code}
    return AutoProcessor.from_pretrained(str(root), **extra), settings


def check_rendering(processor, settings, rows) -> None:
    """The first row with images, rendered as the ranks will: a template that drops image items (a text template
    as the processor's own) would stop every rank in the processor; stop here instead, with the fix."""
    from .mm_collate import MultimodalCollator

    if settings.name == "llama3_2_vision":  # its template raises on a system message beside images
        bad = next((i for i, r in enumerate(rows["mm"]) if '"type": "image"' in r
                    and json.loads(r)["messages"][0]["role"] == "system"), None)
        if bad is not None:
            raise ConfigError(f"conversation {bad}: chat_template='llama3_2_vision' takes no system message in a "
                              "conversation with images (Meta's format; Axolotl's template raises too); set "
                              "drop_system_message: true on the dataset, or remove the system turns")
    first = next((json.loads(r) for r in rows["mm"] if '"type": "image"' in r), None)
    mark = getattr(processor, "image_token", None)
    if first is None or settings.name is not None or not mark:  # a named template writes the family's placeholder
        return
    images = sum(i["type"] == "image" for m in first["messages"] for i in m["content"])
    text = MultimodalCollator(processor, settings).render(first["messages"])
    if text.count(mark) < images:
        which = "chat_template_jinja" if settings.template else "the processor's own chat template"
        raise ConfigError(f"{which} renders {text.count(mark)} {mark!r} placeholder(s) for a conversation with "
                          f"{images} image(s): it does not render image items; name a vision template (chat_template: "
                          "llava, qwen2_vl, pixtral, gemma3, ...) or give a template that writes the image token")


def vision_trains(cfg) -> bool:
    """Whether the vision tower may get gradients: full fine-tuning, or LoRA on every Linear (lora_target_linear),
    unless freeze_mm_modules."""
    return not cfg.freeze_mm_modules and (cfg.adapter not in ("lora", "qlora") or bool(cfg.lora_target_linear))


def _image_only_layers(cfg) -> str | None:
    """The checkpoint's decoder layers that run only with images (Mllama's cross_attention_layers), as words."""
    from transformers import AutoConfig

    extra = {} if cfg.trust_remote_code is None else {"trust_remote_code": cfg.trust_remote_code}
    try:
        config = AutoConfig.from_pretrained(cfg.base_model_config or cfg.base_model, **extra)
    except (OSError, ValueError):  # no config to read here: the model's own load reports that, before training
        return None
    text = getattr(config, "text_config", config)
    layers = getattr(text, "cross_attention_layers", None)
    return f"the cross-attention layers {list(layers)} of {type(config).__name__}" if layers else None


def check_imageless(cfg, rows, dp: int) -> None:
    """Refuse rows without an image where the vision tower trains over several data-parallel ranks: a micro-batch
    without an image leaves the tower without gradients on its rank while another rank has them, and FSDP2's
    reduce-scatter of the tower's group then gets different sizes from the ranks (the collective fails).

    A model that skips decoder layers for a micro-batch without images (Llama 3.2 Vision's cross-attention layers)
    is refused such rows whatever trains: the ranks would run different layers, and FSDP2's all-gathers (DDP's
    reductions) of those layers would wait forever on the rank that skipped them."""
    if dp <= 1:
        return
    missing = sum('"type": "image"' not in row for row in rows["mm"])
    skipped = _image_only_layers(cfg) if missing else None
    if skipped:
        raise ConfigError(f"{missing} of {len(rows)} multimodal rows have no image, over {dp} data-parallel ranks: "
                          f"{skipped} run only for a micro-batch with images, so a rank without one would skip "
                          "layers the other ranks all-gather (a hang); give every row an image, drop the rows "
                          "without one, or use tensor_parallel_size instead of data parallelism")
    if missing and vision_trains(cfg):
        raise ConfigError(f"{missing} of {len(rows)} multimodal rows have no image, and the vision tower trains over "
                          f"{dp} data-parallel ranks: a micro-batch without an image leaves it without gradients on "
                          "its rank while other ranks have them, which the sharded/replicated gradient reduction "
                          "cannot pair; set freeze_mm_modules: true (train the language model), use adapter: lora on "
                          "the language model's layers (lora_target_modules), give every row an image, or use "
                          "tensor_parallel_size instead of data parallelism")
