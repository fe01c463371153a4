"""Vision-language rows through mistral-common (`processor_type` + `tokenizer_use_mistral_common`,
nd_parallel/cli/train/data/mm_mistral.py): the batch a rank builds (image tokens, padded images, label masks) and
the refusals before any rank starts. Training parity (FSDP2 / TP2 vs one process) is the mistral3 row of
tests/distributed/test_train_multimodal.py."""

import importlib.util
import json

import pytest
import torch

from nd_parallel.cli.train.data import mm_mistral
from nd_parallel.cli.train.data.mm_collate import MMSettings, MultimodalCollator
from nd_parallel.config import ConfigError
from nd_parallel.testing.multimodal import save_tiny_mistral3, write_images

pytest.importorskip("mistral_common")
pytest.importorskip("cv2")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("mm_mistral")
    model = save_tiny_mistral3(root / "mistral3")
    images = write_images(root / "images", 2, seed=0)
    return mm_mistral.load(model)[0], images, root


def _conversation(image, system=False):
    turns = [{"role": "system", "content": [{"type": "text", "text": "be brief"}]}] if system else []
    return turns + [
        {"role": "user", "content": [{"type": "image", "path": str(image)}, {"type": "text", "text": "what is it"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a thing"}]},
        {"role": "user", "content": [{"type": "text", "text": "and then"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "another"}]}]


def _batch(tokenizer, conversations, **settings):
    collate = MultimodalCollator(tokenizer, MMSettings(name=mm_mistral.NAME, **settings))
    return collate([{"mm": json.dumps({"messages": c})} for c in conversations])


def test_labels_are_the_assistant_turns_and_images_are_padded(tiny):
    tokenizer, images, _ = tiny
    batch = _batch(tokenizer, [_conversation(images[0]), _conversation(images[1], system=True)])
    ids, labels = batch["input_ids"], batch["labels"]
    for row in range(2):
        trained = [i for i, label in zip(ids[row].tolist(), labels[row].tolist()) if label != -100]
        assert tokenizer.decode(trained, skip_special_tokens=False) == "a thing</s>another</s>"
    # one [IMG] per 8x8 pixels (4-pixel patches merged 2x2); rows closed by [IMG_BREAK], the last by [IMG_END]
    sizes = batch["image_sizes"].tolist()
    img = tokenizer.convert_tokens_to_ids("[IMG]")
    for row, (h, w) in enumerate(sizes):
        assert (ids[row] == img).sum().item() == (h // 8) * (w // 8)
    height, width = max(s[0] for s in sizes), max(s[1] for s in sizes)
    assert tuple(batch["pixel_values"].shape) == (2, 3, height, width)
    assert batch["pixel_values"].dtype == torch.float32
    for k, (h, w) in enumerate(sizes):  # zero-padded bottom / right, the image itself untouched
        pixels = batch["pixel_values"][k]
        assert pixels[:, h:, :].abs().sum() == 0 and pixels[:, :, w:].abs().sum() == 0
    assert (batch["attention_mask"].sum(1) == (ids != tokenizer.pad_token_id).sum(1)).all()


def test_train_on_inputs_and_train_on_eos(tiny):
    tokenizer, images, _ = tiny
    conversation = [_conversation(images[0], system=True)]
    everything = _batch(tokenizer, conversation, train_on_inputs=True)
    media = {tokenizer.convert_tokens_to_ids(t) for t in mm_mistral.IMAGE_TOKENS}
    expected = [i for i in everything["input_ids"][0].tolist() if i not in media and i != tokenizer.pad_token_id]
    assert [i for i in everything["labels"][0].tolist() if i != -100] == expected
    none = _batch(tokenizer, conversation, train_on_eos="none")
    trained = [i for i in none["labels"][0].tolist() if i != -100]
    assert tokenizer.decode(trained, skip_special_tokens=False) == "a thinganother"
    for roles, eos, want in ((["user"], "turn", "what is itand then"),  # [/INST] is the answer's start
                             (["system", "assistant"], "last", "be briefa thinganother</s>")):
        got = _batch(tokenizer, conversation, roles_to_train=roles, train_on_eos=eos)["labels"][0].tolist()
        assert tokenizer.decode([i for i in got if i != -100], skip_special_tokens=False) == want, roles


def test_bad_conversations_are_refused_in_the_parent(tiny):
    tokenizer, images, _ = tiny
    image_in_answer = _conversation(images[0])
    image_in_answer[1]["content"].append({"type": "image", "path": str(images[1])})
    with pytest.raises(ConfigError, match="conversation 0: an image in a 'assistant' turn"):
        mm_mistral.check_rows(tokenizer, {"mm": [json.dumps({"messages": image_in_answer})]}, "rows.jsonl")
    no_answer = _conversation(images[0])[:3]
    with pytest.raises(ConfigError, match="rows.jsonl, record 1: mistral-common refuses this conversation"):
        mm_mistral.check_rows(tokenizer, {"mm": [json.dumps({"messages": c}) for c in
                                                 (_conversation(images[0]), no_answer)]}, "rows.jsonl")


def test_a_tokenizer_that_cannot_encode_images_or_no_opencv_is_refused(tiny, tmp_path, monkeypatch):
    from nd_parallel.testing.models import make_text
    from nd_parallel.testing.tekken import write_tiny_tekken

    write_tiny_tekken(tmp_path / "tekken.json", make_text(20, seed=1))  # a text-only tekken.json
    with pytest.raises(ConfigError, match="has no image section"):
        mm_mistral.load(tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cv2" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'nd_parallel\[mistral\]'"):
        mm_mistral.load(tiny[2] / "mistral3")
