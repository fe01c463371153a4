"""Bad PEFT / Trainer input is refused before any collective, with the value and the fix (one process)."""

import pytest
import torch
from peft import IA3Config, LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from nd_parallel.config import ParallelismConfig
from nd_parallel.distributed.tensor_parallel import check_adapters, match_plan, resolve_plan
from nd_parallel.distributed.tensor_parallel_lora import expand_plan, lora_tp_styles
from nd_parallel.models.peft import check_targets
from nd_parallel.plugins.trainer.adopt import check_trainer_args
from nd_parallel.testing.models import tiny_config


def _model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama"))


def test_lora_follows_its_base_layer():
    model = get_peft_model(_model(), LoraConfig(r=2, target_modules=["q_proj", "o_proj"]))
    inner = model.get_base_model()
    plan = expand_plan(inner, match_plan(inner, resolve_plan(inner, None)))
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    assert plan[f"{q}.base_layer"] == "colwise" and plan[f"{q}.lora_B.default"] == "colwise"
    assert f"{q}.lora_A.default" not in plan and q not in plan  # A stays whole; the wrapper itself is not sharded
    assert plan[f"{o}.base_layer"] == "rowwise" and plan[f"{o}.lora_A.default"] == "rowwise"
    assert f"{o}.lora_B.default" not in plan


def test_target_modules_matching_nothing_name_the_candidates():
    with pytest.raises(ValueError, match=r"target_modules=\{'qkv'\} matches no module.*'q_proj'"):
        check_targets(_model(), LoraConfig(target_modules=["qkv"]))


def test_dora_and_ia3_are_refused_under_tp_with_the_layouts_where_they_work():
    dora = get_peft_model(_model(), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)).get_base_model()
    with pytest.raises(NotImplementedError, match=r"DoRA.*works under DDP, FSDP, HSDP, PP and CP"):
        check_adapters(dora, None)
    ia3 = get_peft_model(_model(), IA3Config(target_modules=["q_proj", "down_proj"],
                                               feedforward_modules=["down_proj"])).get_base_model()
    with pytest.raises(NotImplementedError, match=r"PEFT method IA3.*works under DDP, FSDP, HSDP, PP and CP"):
        check_adapters(ia3, None)


def test_lora_on_a_vocab_sharded_embedding_is_refused():
    model = get_peft_model(_model(), LoraConfig(r=2, target_modules=["embed_tokens"])).get_base_model()
    with pytest.raises(NotImplementedError, match="embed_tokens"):
        lora_tp_styles("model.embed_tokens", model.model.embed_tokens, "embedding_rowwise")


class _Args:
    fsdp, deepspeed, parallelism_config, tp_size, eval_strategy = "", None, None, 1, "no"


@pytest.mark.parametrize("field,value,needle", [("fsdp", "full_shard", "fsdp='full_shard'"),
                                                ("deepspeed", "ds.json", "deepspeed='ds.json'"),
                                                ("tp_size", 2, "tp_size=2")])
def test_trainer_arguments_that_fight_the_layout(field, value, needle):
    args = _Args()
    setattr(args, field, value)
    with pytest.raises(ValueError, match=needle):
        check_trainer_args(args, object(), ParallelismConfig(dp_shard_size=2).resolve(2))


def test_trainer_parallelism_config_is_adopted_not_refused():
    # issue 20: TrainingArguments(parallelism_config=ours) attaches nd_parallel in Accelerator(); Accelerate's own is
    # compared with the callback's layout at attach (accelerate_config.refuse_two_layouts, test_accelerate_api.py)
    args = _Args()
    args.parallelism_config = ParallelismConfig(dp_shard_size=2)
    check_trainer_args(args, object(), ParallelismConfig(dp_shard_size=2).resolve(2))


def test_trainer_evaluation_under_pp_runs_with_torch_and_is_refused_with_deepspeed():
    args = _Args()
    args.eval_strategy = "steps"
    check_trainer_args(args, object(), ParallelismConfig(pp_size=2).resolve(2))  # forward-only schedule: allowed
    with pytest.raises(NotImplementedError, match="pp_backend='torch'.*eval_strategy='no'"):
        check_trainer_args(args, object(), ParallelismConfig(pp_size=2, pp_backend="deepspeed").resolve(2))


def test_trl_sft_trainer_refused_where_its_own_loss_is_wrong():
    """TRL's SFTTrainer divides by this rank's tokens (fused head): refused under dp/cp/pp, allowed under tp only.
    A stand-in class from a 'trl.' module, so the test needs no TRL install."""
    from nd_parallel.plugins.trainer.adopt import check_own_loss

    SFTTrainer = type("SFTTrainer", (), {"__module__": "trl.trainer.sft_trainer"})
    Subclass = type("MySFT", (SFTTrainer,), {"__module__": "mine"})
    with pytest.raises(NotImplementedError, match="dp_shard_size=2: its gradients would be wrong"):
        check_own_loss(Subclass(), ParallelismConfig(dp_shard_size=2).resolve(2))
    check_own_loss(SFTTrainer(), ParallelismConfig(tp_size=2).resolve(2))
    check_own_loss(type("Trainer", (), {})(), ParallelismConfig(dp_shard_size=2).resolve(2))
