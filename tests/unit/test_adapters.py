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


def _sft(**args):
    """A stand-in SFTTrainer (class named SFTTrainer from a 'trl.' module, subclassed by the user), without TRL."""
    from types import SimpleNamespace

    SFTTrainer = type("SFTTrainer", (), {"__module__": "trl.trainer.sft_trainer"})
    trainer = type("MySFT", (SFTTrainer,), {"__module__": "mine"})()
    trainer.args = SimpleNamespace(**{"loss_type": "nll", "label_smoothing_factor": 0.0, "packing": False,
                                      "padding_free": False, "packing_strategy": "bfd", **args})
    trainer.compute_loss_func, trainer.aux_loss_enabled = None, False
    return trainer


@pytest.mark.parametrize("change,message", [
    (dict(loss_type="dft"), "loss_type='dft' under dp_shard_size=2: .*use loss_type='nll'"),
    (dict(label_smoothing_factor=0.1), "label_smoothing_factor=0.1 under dp_shard_size=2: .*=0"),
    (dict(use_liger_kernel=True), "use_liger_kernel=True under dp_shard_size=2: .*use_liger_kernel=False"),
])
def test_sft_trainer_options_that_cannot_be_exact_are_refused(change, message):
    from nd_parallel.plugins.trainer.sft import check_sft_args

    with pytest.raises(NotImplementedError, match=message):
        check_sft_args(_sft(**change), ParallelismConfig(dp_shard_size=2).resolve(2))
    check_sft_args(_sft(**change), ParallelismConfig(tp_size=2).resolve(2))  # tp only: the whole batch everywhere
    check_sft_args(_sft(), ParallelismConfig(dp_shard_size=2).resolve(2))


def test_sft_trainer_own_loss_function_and_moe_aux_loss_refused_under_cp():
    from nd_parallel.plugins.trainer.sft import check_sft_args

    trainer = _sft()
    trainer.compute_loss_func = lambda *a, **k: None
    with pytest.raises(NotImplementedError, match="compute_loss_func=<function> under cp_size=2: .*drop it"):
        check_sft_args(trainer, ParallelismConfig(cp_size=2).resolve(2))
    # at adopt time (inside Trainer.__init__) SFTTrainer has not set aux_loss_enabled yet: read from the config
    from types import SimpleNamespace

    trainer = _sft(router_aux_loss_coef=None)
    del trainer.aux_loss_enabled
    moe = SimpleNamespace(output_router_logits=False, router_aux_loss_coef=0.01)
    trainer.model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: moe))
    with pytest.raises(NotImplementedError, match="router auxiliary loss.*under pp_size=2: .*router_aux_loss_coef"):
        check_sft_args(trainer, ParallelismConfig(pp_size=2).resolve(2))
    trainer.args.router_aux_loss_coef = 0.0
    check_sft_args(trainer, ParallelismConfig(pp_size=2).resolve(2))


def test_sft_trainer_padding_free_needs_one_pipeline_micro_batch():
    from nd_parallel.plugins.trainer.sft import check_sft_args, is_sft_trainer

    assert is_sft_trainer(_sft()) and not is_sft_trainer(type("Trainer", (), {})())
    with pytest.raises(ValueError, match="ONE row.*pp_microbatches=2; use ParallelismConfig\\(pp_microbatches=1\\)"):
        check_sft_args(_sft(packing=True), ParallelismConfig(pp_size=2).resolve(2))
    with pytest.raises(ValueError, match="pp_microbatches=4"):
        check_sft_args(_sft(padding_free=True), ParallelismConfig(pp_size=2, pp_microbatches=4).resolve(2))
    check_sft_args(_sft(packing=True), ParallelismConfig(pp_size=2, pp_microbatches=1, pp_schedule="gpipe").resolve(2))
    check_sft_args(_sft(packing=True, packing_strategy="wrapped"), ParallelismConfig(pp_size=2).resolve(2))
    check_sft_args(_sft(packing=True), ParallelismConfig(cp_size=2).resolve(2))  # CP keeps documents apart
    with pytest.raises(NotImplementedError, match="pp_backend='deepspeed'.*use pp_backend='torch'"):
        check_sft_args(_sft(), ParallelismConfig(pp_size=2, pp_backend="deepspeed").resolve(2))


def test_pipeline_token_stats_are_the_sums_behind_accuracy_and_entropy():
    """token_stats (what the pipeline's last stage adds up for SFTTrainer's metrics): unshifted labels are shifted
    like HF's loss, shifted ones (CP) are used as they are; -100 counts nowhere."""
    import torch

    from nd_parallel.distributed.pipeline.torch_backend import token_stats

    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 1.0]]])
    labels = torch.tensor([[-100, 1, 0]])  # predicted from positions 0 and 1: top-1 of position 0 is 0 (wrong)
    valid, correct, entropy = token_stats(logits, labels, shifted=False).tolist()
    logp = torch.log_softmax(logits[0, :2], -1)
    assert (valid, correct) == (2, 0)
    assert abs(entropy - (-(logp.exp() * logp).sum()).item()) < 1e-6
    valid, correct, _ = token_stats(logits, torch.tensor([[0, 1, -100]]), shifted=True).tolist()
    assert (valid, correct) == (2, 2)


def _dpo(name="DPOTrainer", **args):
    """A stand-in TRL trainer (class named DPOTrainer / KTOTrainer from a 'trl.' module), without TRL."""
    from types import SimpleNamespace

    trainer = type(name, (), {"__module__": "trl.trainer.x_trainer"})()
    trainer.args = SimpleNamespace(**{"loss_type": ["sigmoid"], "precompute_ref_log_probs": False,
                                      "sync_ref_model": False, "padding_free": False, **args})
    trainer.aux_loss_enabled = False
    return trainer


@pytest.mark.parametrize("layout,change,message", [
    (dict(pp_size=2), {}, "DPOTrainer under pp_size=2: .*use dp_shard_size / dp_replicate_size / tp_size"),
    (dict(dp_shard_size=2), dict(loss_type=["sigmoid", "aot"]), "loss_type=\\['aot'\\] under .*per-pair loss"),
    (dict(dp_replicate_size=2), dict(loss_type=["sft"]), "loss_type=\\['sft'\\]"),
    (dict(tp_size=2), dict(precompute_ref_log_probs=True), "precompute_ref_log_probs=True .*leave it False"),
    (dict(dp_shard_size=2), dict(sync_ref_model=True), "sync_ref_model=True"),
    (dict(tp_size=2), dict(padding_free=True), "padding_free=True .*padding_free=False"),
])
def test_dpo_trainer_options_that_cannot_be_exact_are_refused(layout, change, message):
    from nd_parallel.plugins.trainer.dpo import check_dpo_args, is_dpo_trainer

    assert is_dpo_trainer(_dpo()) and not is_dpo_trainer(_sft())
    with pytest.raises(NotImplementedError, match=message):
        check_dpo_args(_dpo(**change), ParallelismConfig(**layout).resolve(2))
    check_dpo_args(_dpo(), ParallelismConfig(dp_shard_size=2).resolve(2))
    check_dpo_args(_dpo(loss_type=["aot"]), ParallelismConfig(tp_size=2).resolve(2))  # tp: the whole batch


@pytest.mark.parametrize("layout,change,message", [
    (dict(pp_size=2), {}, "KTOTrainer under pp_size=2: .*use dp_shard_size .* for KTO$"),
    (dict(tp_size=2), dict(precompute_ref_log_probs=True), "KTOTrainer with precompute_ref_log_probs=True"),
    (dict(dp_shard_size=2), dict(sync_ref_model=True), "KTOTrainer with sync_ref_model=True"),
])
def test_kto_trainer_options_that_cannot_be_exact_are_refused(layout, change, message):
    from nd_parallel.plugins.trainer.kto import check_kto_args, is_kto_trainer

    assert is_kto_trainer(_dpo("KTOTrainer")) and not is_kto_trainer(_dpo())
    with pytest.raises(NotImplementedError, match=message):
        check_kto_args(_dpo("KTOTrainer", **change), ParallelismConfig(**layout).resolve(2))
    check_kto_args(_dpo("KTOTrainer"), ParallelismConfig(dp_shard_size=2).resolve(2))


def test_orpo_trainer_under_a_pipeline_or_with_the_router_loss_under_dp_is_refused():
    from nd_parallel.plugins.trainer.orpo import check_orpo_args, is_orpo_trainer

    assert is_orpo_trainer(_dpo("ORPOTrainer")) and not is_orpo_trainer(_dpo())
    with pytest.raises(NotImplementedError, match="ORPOTrainer under pp_size=2: it builds its loss from the whole "
                                                  "logits after the forward.*for ORPO$"):
        check_orpo_args(_dpo("ORPOTrainer"), ParallelismConfig(pp_size=2).resolve(2))
    moe = _dpo("ORPOTrainer")
    moe.aux_loss_enabled = True
    with pytest.raises(NotImplementedError, match="MoE router auxiliary loss.*ORPOConfig"):
        check_orpo_args(moe, ParallelismConfig(cp_size=2).resolve(2))
    for layout in (dict(dp_shard_size=2), dict(tp_size=2), dict(cp_size=2)):
        check_orpo_args(_dpo("ORPOTrainer"), ParallelismConfig(**layout).resolve(2))
    check_orpo_args(moe, ParallelismConfig(tp_size=2).resolve(2))  # tp: the same tokens on every rank


def test_lora_target_linear_is_axolotls_list_and_expert_lora_trains_without_dropout():
    """Axolotl's examples/mistral/mistral-qlora-fsdp.yml (Mixtral, lora_target_linear, lora_dropout 0.05): peft's
    'all-linear' on a transformers 5 Mixtral adds the fused expert tensors, whose ParamWrapper refused the dropout.
    Axolotl's list (the Linear layers' names) adapts the attention; experts named the v4 way train without dropout."""
    from nd_parallel.models.peft import expert_lora_without_dropout, linear_target_names

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("mixtral"))
    assert linear_target_names(model) == ["k_proj", "o_proj", "q_proj", "v_proj"]  # no lm_head, router, experts
    assert linear_target_names(model, "w2") == ["k_proj", "o_proj", "q_proj", "v_proj", "w2"]
    gpt2 = AutoModelForCausalLM.from_config(tiny_config("gpt2"))  # Conv1D layers, as peft's all-linear finds them
    assert linear_target_names(gpt2) == ["c_attn", "c_fc", "c_proj"]
    lora = get_peft_model(model, LoraConfig(r=2, lora_dropout=0.05, target_modules=linear_target_names(model)))
    assert not lora.peft_config["default"].target_parameters
    with pytest.raises(ValueError, match="lora_dropout != 0"):  # what the ranks stopped at before
        get_peft_model(AutoModelForCausalLM.from_config(tiny_config("mixtral")),
                       LoraConfig(r=2, lora_dropout=0.05, target_modules=["q_proj", "w1", "w2", "w3"]))
    with expert_lora_without_dropout() as undropped:
        lora = get_peft_model(AutoModelForCausalLM.from_config(tiny_config("mixtral")),
                              LoraConfig(r=2, lora_dropout=0.05, target_modules=["q_proj", "w1", "w2", "w3"]))
    assert set(undropped) == {"gate_up_proj", "down_proj"}
    q = lora.get_base_model().model.layers[0].self_attn.q_proj
    assert isinstance(q.lora_dropout["default"], torch.nn.Dropout) and q.lora_dropout["default"].p == 0.05
    from peft.tuners.lora.layer import ParamWrapper
    assert ParamWrapper.__init__.__qualname__ == "ParamWrapper.__init__"  # peft's own again after the block
    lora(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()  # the expert adapters train
