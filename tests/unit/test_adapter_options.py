"""peft's pass-through LoRA options (cli/train/adapter_options.py): what reaches LoraConfig / get_peft_model, the
refusals in the config stage and under the layouts that split what they need; FSDP2's grouping of layers that
share parameters (distributed/fsdp.sharing_groups). Parity: tests/distributed/test_train_peft_options.py."""

import json

import pytest
import torch

from nd_parallel.cli.train import adapter_options
from nd_parallel.cli.train.config import load_train_config
from nd_parallel.config import ConfigError, ParallelismConfig
from nd_parallel.distributed.fsdp import sharing_groups

BASE = {"base_model": "./m", "datasets": [{"path": "d.jsonl", "type": "completion"}], "adapter": "lora"}


def _load(tmp_path, **keys):
    (tmp_path / "c.yml").write_text(json.dumps({**BASE, **keys}))
    return load_train_config(tmp_path / "c.yml", environ={})


def test_the_options_reach_peft(tmp_path):
    cfg = _load(tmp_path, peft_trainable_token_indices={"embed_tokens": [1, 2]}, peft_layer_replication=[[0, 2],
                                                                                                        [1, 2]],
                peft_ensure_weight_tying=False, peft_autocast_adapter_dtype=False)
    assert adapter_options.lora_config_kwargs(cfg) == {"trainable_token_indices": {"embed_tokens": [1, 2]},
                                                       "layer_replication": [(0, 2), (1, 2)],
                                                       "ensure_weight_tying": False}
    assert adapter_options.peft_model_kwargs(cfg) == {"autocast_adapter_dtype": False}
    plain = _load(tmp_path)
    assert adapter_options.lora_config_kwargs(plain) == {} and adapter_options.peft_model_kwargs(plain) == {}
    from peft import LoraConfig  # peft takes them as written

    LoraConfig(r=2, target_modules=["q_proj"], **adapter_options.lora_config_kwargs(cfg))


@pytest.mark.parametrize("keys,match", [
    ({"peft_trainable_token_indices": [1, "a"]}, "write a list of token ids"),
    ({"peft_trainable_token_indices": {"embed_tokens": []}}, "write a list of token ids"),
    ({"peft_layer_replication": [[2, 1]]}, r"write a list of \[start, end\) layer ranges"),
    ({"peft_layer_replication": [0, 2]}, r"write a list of \[start, end\) layer ranges"),
    ({"peft_ensure_weight_tying": "yes"}, "peft_ensure_weight_tying='yes'; use true or false"),
    ({"peft_trainable_token_indices": [1], "adapter": None}, "without adapter: lora"),
])
def test_bad_values_are_refused(tmp_path, keys, match):
    with pytest.raises(ConfigError, match=match):
        _load(tmp_path, **keys)


def test_layouts_that_split_what_they_need_are_refused(tmp_path):
    tokens, replicated = _load(tmp_path, peft_trainable_token_indices=[3]), _load(tmp_path,
                                                                                 peft_layer_replication=[[0, 2]])
    for cfg in (tokens, replicated):
        for ok in (ParallelismConfig(dp_shard_size=2), ParallelismConfig(dp_replicate_size=2),
                   ParallelismConfig(cp_size=2)):
            adapter_options.check_layout(cfg, ok, "c.yml")
    with pytest.raises(ConfigError, match="peft_trainable_token_indices with tp_size=2: the trainable rows"):
        adapter_options.check_layout(tokens, ParallelismConfig(tp_size=2), "c.yml")
    with pytest.raises(ConfigError, match="peft_layer_replication with pp_size=2: the replicated layers share"):
        adapter_options.check_layout(replicated, ParallelismConfig(pp_size=2), "c.yml")


def test_layers_sharing_a_parameter_are_grouped():
    """Transitively and in layer order: 0-2 share a weight, 2-3 another; 1 and 4 share nothing."""
    layers = [torch.nn.Linear(2, 2) for _ in range(5)]
    layers[2].weight = layers[0].weight
    layers[3].bias = layers[2].bias
    groups = sharing_groups(layers)
    assert [[layers.index(m) for m in g] for g in groups] == [[0, 2, 3], [1], [4]]
    assert sharing_groups(layers[:2]) == [[layers[0]], [layers[1]]]
