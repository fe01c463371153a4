"""Axolotl keys acted on since issue 19's later stops, read by `nd-parallel train` in one process (no ranks):
chat-template variables, the embedding table's size and untrained rows, selective checkpointing, kernel / loader keys
of the same math, from_pretrained's extra arguments."""

import json

import pytest

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.config import ConfigError
from tests.distributed.train_yaml_helpers import write_model_and_data
from tests.unit.test_axolotl_configs import _trained, _write


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_model_and_data(tmp_path_factory.mktemp("more_keys_data"), n=24)


THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not "
            "enable_thinking %}<think></think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}")


def test_chat_template_kwargs_reach_the_template(tmp_path, data):
    """chat_template_kwargs (Axolotl passes them to apply_chat_template): the template variable changes the
    rendering, and the answer is still the trained part; set wrong, or with a processor, it is refused."""
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    keys = {"chat_template": "jinja", "chat_template_jinja": THINKING, "eot_tokens": ["<|im_end|>"],
            "tokens": ["<|im_end|>", "<|im_start|>"],
            "datasets": [{"path": str(tmp_path / "c.jsonl"), "type": "chat_template"}]}
    texts = {}
    for thinking in (False, True):
        trained, rows, tok = _trained(tmp_path, data, chat_template_kwargs={"enable_thinking": thinking}, **keys)
        texts[thinking] = tok.decode(rows[0]["input_ids"])
        assert trained == ["yo<|im_end|>"], trained
    assert "<think></think>yo" in texts[False] and "<think>" not in texts[True]
    for value, match in (([1], "write a mapping of template variables"),
                         ({"tokenize": True}, "sets tokenize: the rendering itself sets these")):
        with pytest.raises(ConfigError, match=match):
            _trained(tmp_path, data, chat_template_kwargs=value, **keys)

def test_shrink_embeddings_cuts_the_table_to_the_tokenizer(tmp_path):
    """Axolotl's _resize_token_embeddings: the table grows to the tokenizer's length always, and shrinks to it only
    with shrink_embeddings (a tied lm_head with it); the kept rows are the old ones."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM

    from nd_parallel.cli.train.embeddings import resize
    from nd_parallel.testing.models import save_tiny_model

    path = save_tiny_model("qwen3", tmp_path / "m", seed=0)  # untied lm_head
    opts = dict(resize_token_embeddings_to_32x=False, mean_resizing_embeddings=False)
    for shrink, want in ((False, None), (True, 40)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        have, old = model.get_input_embeddings().num_embeddings, model.get_output_embeddings().weight.clone()
        resize(model, SimpleNamespace(shrink_embeddings=shrink, **opts), 40)
        rows = model.get_input_embeddings().num_embeddings
        assert rows == (want or have) and model.get_output_embeddings().weight.shape[0] == rows
        assert torch.equal(model.get_output_embeddings().weight, old[:rows])
    resize(model, SimpleNamespace(shrink_embeddings=False, **opts), 50)  # grown: always
    assert model.get_input_embeddings().num_embeddings == 50
    with pytest.raises(ConfigError, match="shrink_embeddings='no'; use true or false"):
        load_train_config(_write(tmp_path, "shrink_embeddings: 'no'\n"), environ={})


def test_fix_untrained_tokens_values(tmp_path):
    """A list adds token ids; an int is read as Axolotl's train.py reads it (detection only), with a line."""
    from nd_parallel.cli.train.embeddings import notes

    cfg = load_train_config(_write(tmp_path, "fix_untrained_tokens: [3, 7]\n"), environ={})
    assert cfg.fix_untrained_tokens == [3, 7] and not notes({"fix_untrained_tokens": [3, 7]})
    cfg = load_train_config(_write(tmp_path, "fix_untrained_tokens: 5\n"), environ={})
    assert any(n.startswith("fix_untrained_tokens=5: read as Axolotl 0.19 reads an int") for n in cfg.notes)
    with pytest.raises(ConfigError, match="fix_untrained_tokens=\\['a'\\]: write true"):
        load_train_config(_write(tmp_path, "fix_untrained_tokens: [a]\n"), environ={})

def test_selective_checkpointing_and_same_math_keys(tmp_path):
    """selective_checkpointing with gradient_checkpointing is nd_parallel's selective mode (one line); without it,
    nothing is checkpointed (Axolotl's meaning, one line). Kernel / loader keys of the same math: one line each."""
    cfg = load_train_config(_write(tmp_path, "gradient_checkpointing: true\nselective_checkpointing: true\n"),
                            environ={})
    assert cfg.parallel.activation_checkpointing == "selective"
    cfg = load_train_config(_write(tmp_path, "selective_checkpointing: {save: [attention]}\n"), environ={})
    assert cfg.parallel.activation_checkpointing is None
    assert any(n.startswith("selective_checkpointing without gradient_checkpointing") for n in cfg.notes)
    with pytest.raises(ConfigError, match="selective_checkpointing=3: write true"):
        load_train_config(_write(tmp_path, "gradient_checkpointing: true\nselective_checkpointing: 3\n"), environ={})
    keys = ("ring_attn_func: varlen_llama3\nheads_k_stride: 1\nsdpa_varlen: true\nqlora_sharded_model_loading: true\n"
            "generate_samples: true\nembeddings_skip_upcast: true\nmerge_lora: true\nadam_beta3: 0.99\n"
            "multipack_real_batches: true\nauto_find_batch_size: true\nqgalore_rank: 8\n")
    notes = load_train_config(_write(tmp_path, keys), environ={}).notes
    for key in ("ring_attn_func", "heads_k_stride", "sdpa_varlen", "qlora_sharded_model_loading", "generate_samples",
                "embeddings_skip_upcast", "merge_lora", "adam_beta3", "multipack_real_batches", "auto_find_batch_size",
                "qgalore_rank"):
        assert sum(n.startswith(f"{key}: ") for n in notes) == 1, (key, notes)


def test_model_kwargs_reach_from_pretrained(tmp_path):
    """model_kwargs (Axolotl's overrides_of_model_kwargs, either name): from_pretrained's extra arguments, a config
    field among them; what the run sets itself is refused with its own key."""
    from nd_parallel.cli.train.load_options import load_kwargs

    cfg = load_train_config(_write(tmp_path, "overrides_of_model_kwargs: {use_cache: false}\n"), environ={})
    assert load_kwargs(cfg) == {"use_cache": False}
    with pytest.raises(ConfigError, match="model_kwargs.device_map: the run sets it; use the layout"):
        load_train_config(_write(tmp_path, "model_kwargs: {device_map: auto}\n"), environ={})
    with pytest.raises(ConfigError, match="overrides_of_model_config and model_config both set"):
        load_train_config(_write(tmp_path, "model_config: {a: 1}\noverrides_of_model_config: {a: 2}\n"),
                          environ={})
