"""Our test YAMLs against Axolotl's FSDP and kernel keys: every fsdp_config transformer_layer_cls_to_wrap they name
(the values Axolotl's examples use) is a class of the family's model, checked by the parent's model check, and the
YAMLs under refused/ (CUDA-only features) are refused with their alternative."""

from pathlib import Path

import pytest

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.config import ConfigError

CONFIGS = Path(__file__).resolve().parent.parent / "axolotl_configs"
YAMLS = sorted(CONFIGS.glob("*.yml"))

REFUSED_YAMLS = sorted((CONFIGS / "refused").glob("*.yml"))


@pytest.mark.parametrize("path", REFUSED_YAMLS, ids=[p.stem for p in REFUSED_YAMLS])
def test_every_refused_test_yaml_is_refused_for_a_cuda_only_feature_with_its_alternative(path):
    """The YAMLs under refused/ use keys of Axolotl's examples that need CUDA-only kernels: refused in one message,
    every line naming CUDA and what to do instead."""
    with pytest.raises(ConfigError) as err:
        load_train_config(path, environ={})
    lines = str(err.value).split("\n  - ")[1:]
    assert lines and all("CUDA" in line or "belongs to" in line for line in lines), lines
    assert all(" drop it" in line or "instead" in line or "train in" in line for line in lines), lines


# Families whose tiny config the wrap-class check cannot build as a causal LM (it then leaves the check to the ranks):
# Mistral Small 4's checkpoints are Mistral 3 image-text models around Mistral 4 layers.
UNBUILT = {"mistral4"}
FAMILY = {"gpt_oss_mxfp4": "gpt_oss", "llama4_text_linearized": "llama4_text"}  # model directory -> family
# Tiny-config overrides so the model has every class the YAML names (Jamba: an attention layer besides Mamba).
OVERRIDES = {"jamba": {"attn_layer_period": 2, "attn_layer_offset": 1}}


def test_every_wrap_class_our_yamls_name_is_a_class_of_their_family(tmp_path):
    """fsdp_config transformer_layer_cls_to_wrap in our YAMLs (the values Axolotl's examples use, one family each)
    passes the parent's model check on a tiny model of the family the YAML names, and a class of another family is
    refused there: the check ran on that model."""
    from dataclasses import replace

    from nd_parallel import ParallelismConfig
    from nd_parallel.cli.train.job import check_local_model
    from nd_parallel.testing.models import tiny_config

    fsdp2, checked, unbuilt = ParallelismConfig(dp_shard_size=2).resolve(2), [], []
    for path in YAMLS:
        cfg = load_train_config(path, environ={})
        family = FAMILY.get(Path(cfg.base_model).name, Path(cfg.base_model).name)
        if not cfg.fsdp_wrap_classes:
            continue
        model_dir = tmp_path / family
        if not model_dir.exists():
            tiny_config(family, **OVERRIDES.get(family, {})).save_pretrained(model_dir)
        cfg = replace(cfg, base_model=str(model_dir), model_config=None, lora_model_dir=None)
        check_local_model(cfg, fsdp2, path.name)
        try:
            check_local_model(replace(cfg, fsdp_wrap_classes=["NotAClassOfAnyModel"]), fsdp2, path.name)
            unbuilt.append(family)
        except ConfigError as err:
            assert "names NotAClassOfAnyModel, which" in str(err), err
            checked.append(family)
    assert set(unbuilt) == UNBUILT, unbuilt
    assert {"dbrx", "deepseek_v2", "jamba", "deepseek_v4", "glm4_moe_lite", "glm_moe_dsa", "minimax_m2", "qwen3_5",
            "qwen3_5_moe", "llama", "qwen3_moe"} <= set(checked), sorted(checked)
