"""Pipeline stages of families whose decoder layers return tuples (falcon, bloom with ALiBi) or whose modules are
registered out of execution order (OPT: its final norm before its layers), checked in one process: the stages'
skeletons run one after the other give the whole model's logits. Their PP2 training parity with one process is
in tests/distributed/test_parity.py (the "families" launch)."""

import pytest
import torch

from nd_parallel.distributed.pipeline.split import split_stages
from nd_parallel.distributed.pipeline.stage import PassThrough, make_stage_module
from nd_parallel.models.hf import model_parts, output_arity
from nd_parallel.testing.models import tiny_config

FAMILIES = ["falcon", "bloom", "opt", "gpt2", "llama"]


def build(model_type: str, layers: int = 4):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, num_hidden_layers=layers))


def test_opt_final_norm_runs_after_the_layers_though_registered_before():
    parts = model_parts(build("opt"))
    assert "model.decoder.final_layer_norm" in parts.post
    assert parts.pre == ("model.decoder.embed_tokens", "model.decoder.embed_positions")


@pytest.mark.parametrize("model_type,arity", [("falcon", 2), ("bloom", 2), ("opt", 0), ("llama", 0)])
def test_layer_output_arity_is_read_from_the_layer(model_type, arity):
    model = build(model_type)
    layer = model_parts(model).layers_fqn
    assert output_arity(model.get_submodule(layer)[0]) == arity


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("stages", [2, 3])
def test_stages_in_sequence_equal_the_whole_model(model_type, stages):
    """Right padding included: bloom's ALiBi and OPT's learned positions come from the mask on every stage."""
    model = build(model_type).eval()
    ids = torch.randint(3, 120, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    parts = model_parts(model)
    specs = split_stages(parts, stages)
    skeletons = [make_stage_module(model, parts, spec, stages) for spec in specs]
    x = ids
    for skeleton in skeletons:
        x = skeleton(x, attention_mask=mask)
    expected = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(x, expected, rtol=0, atol=1e-6)
    stand_ins = [m for m in skeletons[-1].modules() if isinstance(m, PassThrough)]
    assert stand_ins and all(s.arity == output_arity(model.get_submodule(parts.layers_fqn)[0]) for s in stand_ins)


@pytest.mark.parametrize("model_type,layer", [("trocr", "TrOCRDecoderLayer"), ("rwkv", "RwkvBlock"),
                                              ("mvp", "MvpDecoderLayer")])
def test_layers_returning_a_tuple_built_at_run_time_are_refused(model_type, layer):
    """``return outputs`` / ``(x,) + outputs``: no stand-in can know the length, so the split is refused by the
    checks that run before any collective (validate_pipeline, step 1 of parallelize), not crash in a stage."""
    from nd_parallel import ParallelismConfig
    from nd_parallel.distributed.pipeline import validate_pipeline
    from nd_parallel.models.hf import UnsplittableModel

    model = build(model_type, layers=2)
    assert output_arity(model.get_submodule(model_parts(model).layers_fqn)[0]) is None
    with pytest.raises(UnsplittableModel, match=rf"{layer}.forward returns a tuple whose length is decided at run "
                                                r"time.*use pp_size=1"):
        validate_pipeline(model, ParallelismConfig(pp_size=2))


def test_layers_wider_than_the_embeddings_get_embedding_shaped_zeros():
    """DeepSeek-V4's hyper-connections pass [batch, seq, streams, hidden] between layers and expand the embeddings
    into that themselves: a later stage hands the model zeros of the embeddings' shape, not of the activation's."""
    from transformers import AutoModelForCausalLM

    from nd_parallel.testing.tiny_configs import tiny_sweep_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_sweep_config("deepseek_v4")).eval()
    ids = torch.randint(3, 120, (2, 10))
    parts = model_parts(model)
    specs = split_stages(parts, 2)
    skeletons = [make_stage_module(model, parts, spec, 2) for spec in specs]
    x = ids
    for skeleton in skeletons:
        x = skeleton(x)
    torch.testing.assert_close(x, model(input_ids=ids).logits, rtol=0, atol=1e-6)


def test_layers_fed_from_the_token_ids_are_refused():
    """Gemma-4's layers take per-layer embeddings of the token ids, which stages after the first do not have."""
    from transformers import AutoModelForCausalLM

    from nd_parallel import ParallelismConfig
    from nd_parallel.distributed.pipeline import validate_pipeline
    from nd_parallel.models.hf import UnsplittableModel
    from nd_parallel.testing.tiny_configs import tiny_sweep_config

    model = AutoModelForCausalLM.from_config(tiny_sweep_config("gemma4_text"))
    with pytest.raises(UnsplittableModel, match=r"takes per_layer_input, which .* computes from the token ids.*"
                                                r"use pp_size=1"):
        validate_pipeline(model, ParallelismConfig(pp_size=2))


def test_layers_handing_state_to_the_next_layer_are_refused():
    """HY-V4's shared sparse-attention layers take the previous layer's top-k indices (``prev_topk_indices``):
    stages pass only hidden states, so the split is refused up front, found from the base model's layer loop."""
    from transformers import AutoModelForCausalLM

    from nd_parallel import ParallelismConfig
    from nd_parallel.distributed.pipeline import validate_pipeline
    from nd_parallel.distributed.pipeline.stage import carried_layer_state
    from nd_parallel.models.hf import UnsplittableModel
    from nd_parallel.testing.tiny_configs import tiny_sweep_config

    model = AutoModelForCausalLM.from_config(tiny_sweep_config("hy_v4"))
    assert carried_layer_state(model.model) == ["prev_topk_indices=topk_indices"]
    assert carried_layer_state(build("llama").model) == []
    with pytest.raises(UnsplittableModel, match=r"HYV4Model's loop over its decoder layers hands each layer's output "
                                                r"to the next.*prev_topk_indices.*use pp_size=1"):
        validate_pipeline(model, ParallelismConfig(pp_size=2))


def test_layers_fed_a_copy_of_the_embeddings_are_refused():
    """Zamba2 hands every layer ``original_hidden_states`` (a clone of the embeddings): a later stage would feed
    its layers the stand-in zeros, a silent difference; refused up front, from the base model's source."""
    from transformers import AutoModelForCausalLM

    from nd_parallel import ParallelismConfig
    from nd_parallel.distributed.pipeline import validate_pipeline
    from nd_parallel.distributed.pipeline.stage import embeddings_fed_to_layers
    from nd_parallel.models.hf import UnsplittableModel
    from nd_parallel.testing.tiny_configs import tiny_sweep_config

    model = AutoModelForCausalLM.from_config(tiny_sweep_config("zamba2"))
    assert embeddings_fed_to_layers(model.model) == ["original_hidden_states"]
    assert embeddings_fed_to_layers(build("llama").model) == []
    with pytest.raises(UnsplittableModel, match=r"Zamba2Model hands its decoder layers a copy of the embeddings "
                                                r"\(original_hidden_states\).*use pp_size=1"):
        validate_pipeline(model, ParallelismConfig(pp_size=2))


def test_stand_ins_keep_the_attributes_the_loop_reads():
    """NemotronH's loop reads ``block_type`` from every layer to pick its mask, stand-ins included."""
    from transformers import AutoModelForCausalLM

    from nd_parallel.testing.tiny_configs import tiny_sweep_config

    model = AutoModelForCausalLM.from_config(tiny_sweep_config("nemotron_h"))
    parts = model_parts(model)
    layer = model.get_submodule(parts.layers_fqn)[0]
    stand_in = PassThrough(output_arity(layer), layer)
    assert stand_in.block_type == layer.block_type and not list(stand_in.parameters())
