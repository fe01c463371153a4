"""processor_type (multimodal.py, data/mm_rows.py, data/mm_collate.py) in one process: Axolotl's multimodal keys
read with its meaning, what cannot work refused in the config stage with the fix, image rows normalised in the
parent, and each micro-batch's labels masked as Axolotl's processing strategies mask them (the tokens kept are
decoded and compared as text)."""

import base64
import json

import pytest

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.cli.train.data.mm_collate import MMSettings, MultimodalCollator, load_image
from nd_parallel.cli.train.data.mm_rows import normalise
from nd_parallel.cli.train.data.mm_templates import template_for
from nd_parallel.cli.train.data.sources import DatasetSpec
from nd_parallel.config import ConfigError
from nd_parallel.testing.multimodal import save_tiny_vlm, write_images

HEAD = "base_model: ./m\nprocessor_type: AutoProcessor\ndatasets:\n  - path: ./d.jsonl\n    type: chat_template\n"


def _load(tmp_path, extra: str, head: str = HEAD):
    path = tmp_path / "c.yml"
    path.write_text(head + extra)
    return load_train_config(path, environ={})


def test_axolotls_multimodal_keys_are_read(tmp_path):
    cfg = _load(tmp_path, "skip_prepare_dataset: true\nremove_unused_columns: false\nsample_packing: false\n"
                          "chat_template: llava\nimage_size: 224\nimage_resize_algorithm: bicubic\n"
                          "freeze_mm_modules: true\nmodel_type: AutoModelForImageTextToText\n"
                          "processor_kwargs: {min_pixels: 3136}\n")
    assert (cfg.processor_type, cfg.chat_template, cfg.image_size, cfg.image_resize_algorithm) == (
        "AutoProcessor", "llava", 224, "bicubic")
    assert cfg.freeze_mm_modules and cfg.processor_kwargs == {"min_pixels": 3136}
    assert _load(tmp_path, "model_type: Qwen2VLForConditionalGeneration\nimage_size: [32, 24]\n").image_size == [32, 24]


@pytest.mark.parametrize("extra,needle", [
    ("sample_packing: true\n", "sample_packing=True with processor_type: packing multimodal rows is not supported"),
    ("pipeline_parallel_size: 2\n", "pipeline_parallel_size=2 with processor_type: the vision tower"),
    ("context_parallel_size: 2\n", "context_parallel_size=2 with processor_type: a sequence shard holds only part"),
    ("image_size: [1, 2, 3]\n", "image_size=[1, 2, 3]: write an integer"),
    ("image_resize_algorithm: nearest\n", "image_resize_algorithm='nearest': use one of bilinear"),
    ("processor_type: VoxtralProcessor\n", "processor_type='VoxtralProcessor': audio inputs are not implemented"),
])
def test_what_cannot_work_with_a_processor_is_refused(tmp_path, extra, needle):
    head = HEAD.replace("processor_type: AutoProcessor\n", "") if extra.startswith("processor_type") else HEAD
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, extra, head)
    assert needle in str(err.value), str(err.value)


def test_multimodal_keys_without_a_processor_are_refused(tmp_path):
    head = HEAD.replace("processor_type: AutoProcessor\n", "")
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, "model_type: LlavaForConditionalGeneration\nfreeze_mm_modules: true\nchat_template: llava\n",
              head)
    message = str(err.value)
    for needle in ("freeze_mm_modules=True without processor_type", "chat_template='llava' renders images through "
                   "a processor: set processor_type"):
        assert needle in message, message
    assert "model_type" not in message  # an image-text class alone: Axolotl's text-only run of it (multimodal.py)
    from nd_parallel.cli.train.multimodal import image_text_class

    cfg = _load(tmp_path, "model_type: Gemma3ForConditionalGeneration\nchat_template: gemma3\n", head)
    assert image_text_class(cfg) and not cfg.processor_type
    with pytest.raises(ConfigError, match=r"model_type='Gemma3ForConditionalGeneration' \(an image-text class, "
                                          r"trained on text\) with pp_size=2: the outer model's forward is neither"):
        _load(tmp_path, "model_type: Gemma3ForConditionalGeneration\npipeline_parallel_size: 2\n", head)
    with pytest.raises(ConfigError, match=r"datasets\[0\].type='alpaca' with processor_type"):
        _load(tmp_path, "", HEAD.replace("type: chat_template", "type: alpaca"))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("images"), 2, seed=0)


def test_rows_take_paths_base64_and_an_images_column(images, monkeypatch):
    spec = DatasetSpec(path="d.jsonl", type="chat_template")
    monkeypatch.chdir(images[0].parent)  # relative paths start at the working directory, as in Axolotl
    encoded = base64.b64encode(images[1].read_bytes()).decode()
    record = {"messages": [{"role": "user", "content": [{"type": "image", "path": images[0].name},
                                                        {"type": "text", "text": "hi"}]},
                           {"role": "assistant", "content": "ok"},
                           {"role": "user", "content": [{"type": "image", "base64": encoded}]}]}
    out = normalise(record, spec, "r")["messages"]
    assert out[0]["content"][0] == {"type": "image", "path": str(images[0].resolve())}
    assert out[1]["content"] == [{"type": "text", "text": "ok"}]
    assert out[2]["content"] == [{"type": "image", "base64": encoded}]
    legacy = {"conversations": [{"from": "human", "value": "look"}, {"from": "gpt", "value": "a cat"}],
              "images": [str(images[1]), str(images[0])]}  # Axolotl: the first image joins the first user turn
    out = normalise(legacy, spec, "r")["messages"]
    assert [m["role"] for m in out] == ["user", "assistant"]
    assert out[0]["content"] == [{"type": "text", "text": "look"}, {"type": "image", "path": str(images[1].resolve())}]
    bare = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}],
            "image": str(images[0])}  # a bare image item is filled in place
    assert normalise(bare, spec, "r")["messages"][0]["content"][1]["path"] == str(images[0].resolve())


@pytest.mark.parametrize("content,match", [
    ([{"type": "image", "url": "https://example.com/a.png"}], "is a URL; nd-parallel train downloads nothing"),
    ([{"type": "image", "path": "missing/a.png"}], "image file 'missing/a.png' not found"),
    ([{"type": "audio", "path": "a.wav"}], "only text and image items are implemented"),
    ([{"type": "image"}], "an {type: image} item has no image"),
])
def test_bad_image_rows_are_named(content, match):
    with pytest.raises(ConfigError, match=match.replace("{", r"\{").replace("}", r"\}")):
        normalise({"messages": [{"role": "user", "content": content}]}, DatasetSpec(path="d"), "d.jsonl, record 3")


def test_image_size_pads_to_a_square_or_resizes(images):
    from PIL import Image

    with Image.open(images[0]) as opened:
        w, h = opened.size
    assert load_image({"path": str(images[0])}, MMSettings()).size == (w, h)
    assert load_image({"path": str(images[0])}, MMSettings(image_size=30)).size == (30, 30)
    assert load_image({"path": str(images[0])}, MMSettings(image_size=[20, 10], resize="lanczos")).size == (20, 10)


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    from transformers import AutoProcessor

    root = tmp_path_factory.mktemp("vlm")
    return {f: AutoProcessor.from_pretrained(save_tiny_vlm(f, root / f)) for f in ("llava", "gemma3", "mllama")}


def _kept(processor, settings: MMSettings, images, **row) -> tuple[str, str]:
    """(the rendered row, the text of its trained tokens) for one conversation batched with a longer one."""
    turns = row.get("turns") or [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "image", "path": str(images[0])}, {"type": "text", "text": "what"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a dog"}]},
        {"role": "user", "content": [{"type": "text", "text": "more"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "two"}]}]
    longer = [turns[1], {"role": "assistant", "content": [{"type": "text", "text": "padding " * 12}]}]
    collator = MultimodalCollator(processor, settings)
    batch = collator([{"mm": json.dumps({"messages": turns})}, {"mm": json.dumps({"messages": longer})}])
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    assert (batch["labels"][batch["input_ids"] == processor.tokenizer.pad_token_id] == -100).all()
    return collator.render(turns), processor.tokenizer.decode(ids[labels != -100])


def _gemma3(**kw) -> MMSettings:
    template, name = template_for("gemma3", None, None)
    return MMSettings(template=template, name=name, **kw)


def test_gemma3_trains_the_assistant_turns_and_their_end(processors, images):
    text, kept = _kept(processors["gemma3"], _gemma3(), images)
    assert text == ("<s><start_of_turn>user\nbe brief\n\n<start_of_image>what<end_of_turn>\n<start_of_turn>model\n"
                    "a dog<end_of_turn>\n<start_of_turn>user\nmore<end_of_turn>\n<start_of_turn>model\ntwo"
                    "<end_of_turn>\n")
    assert kept == "a dog<end_of_turn>two<end_of_turn>"  # the image's tokens, the prompts and padding: -100


@pytest.mark.parametrize("kw,expect", [
    (dict(train_on_eos="none"), "a dogtwo"),
    (dict(train_on_eos="last"), "a dogtwo<end_of_turn>"),
    (dict(train_on_eos="all"), "<end_of_turn>a dog<end_of_turn><end_of_turn>two<end_of_turn>"),
    # the processor expands <start_of_image> to "\n\n<start_of_image>" + 4 soft tokens + "<end_of_image>\n\n": Axolotl's
    # Gemma 3 strategy masks the first two kinds, and <end_of_image> trains with the user's turn
    (dict(roles_to_train=["user"]), "be brief\n\n\n\n<end_of_image>\n\nwhat<end_of_turn>more<end_of_turn>"),
])
def test_gemma3_roles_and_train_on_eos(processors, images, kw, expect):
    assert _kept(processors["gemma3"], _gemma3(**kw), images)[1] == expect


def test_train_on_inputs_masks_only_padding_and_image_tokens(processors, images):
    text, kept = _kept(processors["gemma3"], _gemma3(train_on_inputs=True), images)
    assert kept == text.replace("<start_of_image>", "\n\n<end_of_image>\n\n")  # boi and soft tokens masked


def test_llava_masks_padding_and_image_tokens_only(processors, images):
    """Axolotl has no role boundaries for llava (its base strategy): every other token trains; the turn's image
    comes first (Axolotl's llava.jinja)."""
    template, name = template_for("llava", None, None)
    text, kept = _kept(processors["llava"], MMSettings(template=template, name=name), images)
    assert text == "be brief USER: <image>\nwhat ASSISTANT: a dog USER: more ASSISTANT: two "
    assert kept == "be brief USER: \nwhat ASSISTANT: a dog USER: more ASSISTANT: two "


def test_qwen2_vl_template_writes_its_default_system_prompt():
    template, name = template_for("qwen2_vl", None, None)
    from jinja2 import Template

    from nd_parallel.cli.train.data.mm_templates import IMAGE_MARKS, flatten

    turns = flatten([{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image"}]}],
                    IMAGE_MARKS[name], False)
    assert Template(template).render(messages=turns, bos_token="") == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nsee<|vision_start|>"
        "<|image_pad|><|vision_end|><|im_end|>\n")


def test_freeze_mm_modules_freezes_the_vision_tower_and_projector(tmp_path):
    from transformers import AutoModelForImageTextToText

    from nd_parallel.cli.train.rank import freeze_mm_modules

    model = freeze_mm_modules(AutoModelForImageTextToText.from_pretrained(save_tiny_vlm("llava", tmp_path)))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(".vision_tower." in n or ".multi_modal_projector." in n for n in frozen)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if "language_model" in n or n.startswith("lm_head")}


def test_pixtral_template_drops_the_system_prompt_of_a_finished_conversation():
    """Axolotl's pixtral.jinja writes the system prompt only before a conversation's final user turn (checked
    against it: llava, qwen2_vl and pixtral render these conversations as Axolotl's own files do)."""
    from jinja2 import Template

    from nd_parallel.cli.train.data.mm_templates import IMAGE_MARKS, flatten

    template, name = template_for("pixtral", None, None)
    turns = [{"role": "system", "content": [{"type": "text", "text": "sys"}]},
             {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
             {"role": "user", "content": [{"type": "text", "text": "more"}]}]
    render = Template(template).render
    flat = flatten(turns, IMAGE_MARKS[name], False)
    assert render(messages=flat, bos_token="<s>", eos_token="</s>") == (
        "<s>[INST][IMG]hi[/INST]ok</s>[INST]sys\n\nmore[/INST]")
    assert render(messages=flat[:3], bos_token="<s>", eos_token="</s>") == "<s>[INST][IMG]hi[/INST]ok</s>"


def test_rows_without_an_image_are_refused_where_the_vision_tower_trains_over_dp_ranks(tmp_path):
    import datasets

    from nd_parallel.cli.train.config import TrainConfig
    from nd_parallel.cli.train.data.mm_rows import check_imageless

    rows = datasets.Dataset.from_list([{"mm": json.dumps({"messages": [{"role": "user", "content": c}]})} for c in (
        [{"type": "text", "text": "a"}], [{"type": "image", "path": "x.png"}])])
    # Llama 3.2 Vision skips its cross-attention layers without images: refused over dp ranks whatever trains
    mllama = str(save_tiny_vlm("mllama", tmp_path / "mllama"))
    for frozen in (dict(freeze_mm_modules=True), dict(adapter="lora", lora_target_modules=["q_proj"])):
        with pytest.raises(ConfigError, match=r"1 of 2 multimodal rows have no image, over 2 data-parallel ranks: "
                                              r"the cross-attention layers \[1\] of MllamaConfig run only"):
            check_imageless(TrainConfig(base_model=mllama, datasets=[], processor_type="AutoProcessor", **frozen),
                            rows, dp=2)
    check_imageless(TrainConfig(base_model=mllama, datasets=[], processor_type="AutoProcessor"), rows, dp=1)
    full = TrainConfig(base_model=str(tmp_path), datasets=[], processor_type="AutoProcessor")  # no config there
    with pytest.raises(ConfigError, match=r"1 of 2 multimodal rows have no image, and the vision tower trains over 2 "
                                          r"data-parallel ranks.*set freeze_mm_modules: true"):
        check_imageless(full, rows, dp=2)
    check_imageless(full, rows, dp=1)  # one rank (or TP): every rank sees the same rows
    for fine in (dict(freeze_mm_modules=True), dict(adapter="lora", lora_target_modules=["q_proj"])):
        check_imageless(TrainConfig(base_model=str(tmp_path), datasets=[], processor_type="AutoProcessor", **fine),
                        rows, dp=2)
    with pytest.raises(ConfigError):  # LoRA on every Linear adapts the vision tower's too
        check_imageless(TrainConfig(base_model=str(tmp_path), datasets=[], processor_type="AutoProcessor",
                                    adapter="lora", lora_target_linear=True), rows, dp=2)


def test_a_template_that_drops_images_is_refused_before_the_ranks(processors, images):
    """The tiny processors carry a text-only ChatML template: as tokenizer_default it would render no image token."""
    import datasets

    from nd_parallel.cli.train.data.mm_rows import check_rendering

    turns = [{"role": "user", "content": [{"type": "image", "path": str(images[0])}, {"type": "text", "text": "a"}]}]
    rows = datasets.Dataset.from_list([{"mm": json.dumps({"messages": turns})}])
    with pytest.raises(ConfigError, match=r"the processor's own chat template renders 0 '<image>' placeholder\(s\) for "
                                          r"a conversation with 1 image\(s\)"):
        check_rendering(processors["llava"], MMSettings(), rows)
    template, name = template_for("llava", None, None)
    check_rendering(processors["llava"], MMSettings(template=template, name=name), rows)



def _raise(message):
    raise ValueError(message)


def test_llama3_2_vision_writes_the_date_without_images_and_refuses_a_system_message_beside_them(processors, images):
    """Meta's format: a conversation without images opens with the dated system turn (the date the parent read,
    the same on every rank; today's where none is given); one with images has no system turn, and a system message
    beside images is refused before any rank starts (drop_system_message is the fix)."""
    from nd_parallel.cli.train.data.mm_rows import check_rendering

    template, name = template_for("llama3_2_vision", None, None)
    text = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]
    collator = MultimodalCollator(processors["mllama"], MMSettings(template=template, name=name,
                                                                   date_string="01 Jan 2000"))
    assert collator.render(text) == ("<s><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
                                     "December 2023\nToday Date: 01 Jan 2000\n\n<|eot_id|><|start_header_id|>user"
                                     "<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
                                     "\n\nyo<|eot_id|>")
    import datetime

    undated = MultimodalCollator(processors["mllama"], MMSettings(template=template, name=name)).render(text)
    assert "Today Date: " + datetime.datetime.now().strftime("%d %b %Y") in undated
    image = {"role": "user", "content": [{"type": "image", "path": str(images[0])}, {"type": "text", "text": "hi"}]}
    assert collator.render([image, text[1]]).startswith("<s><|start_header_id|>user<|end_header_id|>\n\n<|image|>hi")
    system = {"role": "system", "content": [{"type": "text", "text": "be brief"}]}
    rows = {"mm": [json.dumps({"messages": text}), json.dumps({"messages": [system, image, text[1]]})]}
    with pytest.raises(ConfigError, match="conversation 1: chat_template='llama3_2_vision' takes no system message"):
        check_rendering(processors["mllama"], MMSettings(template=template, name=name), rows)


_AXOLOTL_LABELS = """
import json, sys
import torch
from transformers import AutoProcessor
from axolotl.processing_strategies import get_processing_strategy
out = []
for spec in json.loads(sys.argv[1]):
    processor = AutoProcessor.from_pretrained(spec["dir"])
    strategy = get_processing_strategy(processor, None, spec["chat_template"], **spec["kw"])
    out.append(strategy.process_labels(torch.tensor(spec["ids"])).tolist())
from axolotl.utils.chat_templates import get_chat_template
from transformers.utils.chat_template_utils import _compile_jinja_template
conversations = json.loads(sys.argv[2])
renders = {name: [_compile_jinja_template(get_chat_template(name)).render(
    messages=c, bos_token="<s>", eos_token="</s>", date_string="04 Dec 2026") for c in conversations]
    for name in ("llava", "qwen2_vl", "pixtral", "llama3_2_vision")}
print(json.dumps([out, renders]))
"""
_CASES = [("gemma3", {}), ("gemma3", {"train_on_eos": "all"}),
          ("gemma3", {"train_on_eos": "last", "roles_to_train": ["user", "assistant"]}),
          ("gemma3", {"train_on_inputs": True}), ("llava", {}), ("mllama", {}), ("mllama", {"train_on_eos": "none"}),
          # role_boundaries: markers replacing the template's, the start marker trained, an end-of-row turn
          ("gemma3", {"role_boundaries_override": [
              {"role": "assistant", "start": "<start_of_turn>model\n", "end": "<end_of_turn>", "include_start": True},
              {"role": "user", "start": "<start_of_turn>user\n", "end": None}]})]
_TEMPLATE = {"mllama": "llama3_2_vision"}


def test_labels_and_templates_equal_axolotls(processors, images, tmp_path):
    """Our masks on a batch equal those of Axolotl 0.19's own strategy (get_processing_strategy(...).process_labels)
    run in its venv on the same input_ids with the same saved processor, and our llava / qwen2_vl / pixtral
    templates render conversations as its own template files do (one venv call for every case)."""
    from jinja2 import Template

    from nd_parallel.cli.train.data.mm_templates import IMAGE_MARKS, IMAGES_FIRST, flatten
    from nd_parallel.cli.train.data.templates import MM_JINJA
    from tests.unit.axolotl_venv import run_in_axolotl

    turns = [{"role": "user", "content": [{"type": "image", "path": str(images[0])}, {"type": "text", "text": "what"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "a dog"}]},
             {"role": "user", "content": [{"type": "text", "text": "more"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "two"}]}]
    specs, ours = [], []
    for family, kw in _CASES:
        template, name = template_for(_TEMPLATE.get(family, family), None, None)
        collator = MultimodalCollator(processors[family], MMSettings(template=template, name=name, **kw))
        batch = collator([{"mm": json.dumps({"messages": turns})}, {"mm": json.dumps({"messages": turns[:2]})}])
        processors[family].save_pretrained(tmp_path / family)
        specs.append({"dir": str(tmp_path / family), "chat_template": _TEMPLATE.get(family, family), "kw": kw,
                      "ids": batch["input_ids"].tolist()})
        ours.append(batch["labels"].tolist())
    text = [{"type": "text", "text": "be brief"}]
    conversations = [[{**t, "content": [{"type": "image"} if "path" in i else i for i in t["content"]]} for t in turns],
                     [{"role": "system", "content": text}, *turns[2:]]]
    theirs, renders = run_in_axolotl("-c", _AXOLOTL_LABELS, json.dumps(specs), json.dumps(conversations))
    for case, a, b in zip(_CASES, ours, theirs):
        assert a == b, case
    for name, rendered in renders.items():
        template = Template(template_for(name, None, None)[0])
        template.globals["raise_exception"] = _raise
        items = name in MM_JINJA  # a template that reads the content items (llama3_2_vision)
        assert [template.render(messages=c if items else flatten(c, IMAGE_MARKS[name], name in IMAGES_FIRST),
                                bos_token="<s>", eos_token="</s>", date_string="04 Dec 2026")
                for c in conversations] == rendered, name
