"""The LLM Compressor plugin's recipe in the config stage (cli/train/sparsity.py): the ConstantPruningModifier Axolotl's
example runs is accepted, everything else the recipe could ask for is refused with its fix, in the one message; the
masks' matching is llm-compressor's. Training under layouts: tests/distributed/test_train_sparse.py."""

from __future__ import annotations

import pytest

from nd_parallel import ParallelismConfig
from nd_parallel.cli.train import sparsity
from nd_parallel.config import ConfigError

PLUGIN = "axolotl.integrations.llm_compressor.LLMCompressorPlugin"


def _recipe(**args):
    return {"recipe": {"stage": {"finetuning_modifiers": {"ConstantPruningModifier": {
        "targets": ["re:.*q_proj.weight"], **args}}}}}


@pytest.mark.parametrize("block,needle", [
    ({"recipe": {"s": {"finetuning_modifiers": {"SparseGPTModifier": {"sparsity": 0.5}}}}},
     "only ConstantPruningModifier"),
    (_recipe(start=1), "start=1, end=None: the masks hold for the whole run"),
    (_recipe(end=3), "use start: 0 and no end"),
    (_recipe(targets="re:(unclosed"), "is not a regular expression"),
    (_recipe(targets=[]), "write a list of 're:<regex>' patterns"),
    (_recipe(update_frequency=2), "update_frequency not supported"),
    ({"recipe": {}}, "has no modifier"),
    ({"recipe": {"s": {}}, "save_compresed": True}, "llmcompressor.save_compresed: not a key"),
    ("recipe.yaml", "write {recipe:"),
])
def test_what_the_recipe_cannot_do_here_is_refused(block, needle):
    out = sparsity.refusals({"llmcompressor": block, "plugins": [PLUGIN]})
    assert any(needle in line for line in out), out


def test_axolotls_example_recipe_is_accepted_and_matched_as_llm_compressor_matches():
    block = _recipe(start=0)
    block["recipe"]["stage"]["finetuning_modifiers"]["ConstantPruningModifier"]["targets"] += [
        "model.layers.0.mlp.up_proj.weight"]
    assert sparsity.refusals({"llmcompressor": block, "plugins": [PLUGIN]}) == []
    t = sparsity.SparsityOptions(llmcompressor=block)
    patterns = sparsity.targets(t)
    assert sparsity.matches("model.layers.3.self_attn.q_proj.weight", patterns)
    assert sparsity.matches("model.layers.0.mlp.up_proj.weight", patterns)  # an exact name
    assert not sparsity.matches("model.layers.1.mlp.up_proj.weight", patterns)
    assert not sparsity.matches("model.layers.3.self_attn.q_proj.base_layer.weight", patterns)  # LoRA's base
    assert sparsity.notes({"llmcompressor": {**block, "save_compressed": True}})


def test_the_plugin_and_its_block_go_together_and_pipeline_stages_are_refused(tmp_path):
    from nd_parallel.cli.train.config import load_train_config

    head = "base_model: ./m\ndatasets:\n  - path: ./d.jsonl\n    type: completion\n"
    block = ("llmcompressor:\n  recipe:\n    s:\n      finetuning_modifiers:\n        ConstantPruningModifier:\n"
             "          targets: ['re:.*q_proj.weight']\n")
    path = tmp_path / "c.yml"
    path.write_text(head + block)
    with pytest.raises(ConfigError, match=r"llmcompressor=.*list axolotl.integrations.llm_compressor"):
        load_train_config(path, environ={})
    path.write_text(head + f"plugins: [{PLUGIN}]\n" + block)
    cfg = load_train_config(path, environ={})
    assert sparsity.targets(cfg) == ["re:.*q_proj.weight"]
    assert any(n.startswith("llmcompressor: sparse fine-tuning") for n in cfg.notes), cfg.notes
    sparsity.check_layout(cfg, ParallelismConfig(dp_shard_size=2), path)
    with pytest.raises(ConfigError, match=r"llmcompressor with pp_size=2: .* use dp_shard_size or tp_size"):
        sparsity.check_layout(cfg, ParallelismConfig(pp_size=2), path)
