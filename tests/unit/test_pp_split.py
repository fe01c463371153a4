"""The pipeline split is pure: module names per stage, checked without any process."""

import pytest
import torch
import torch.nn as nn

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.distributed.pipeline.split import split_stages, stage_ids_for_rank, uniform_layers
from nd_parallel.models.hf import UnsplittableModel, model_parts
from nd_parallel.testing.models import tiny_config
from tests.unit.test_plugin_errors import fake_accelerator, no_process_group  # noqa: F401  (fixture)


def build(family="llama", **overrides):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_config(family, **overrides))


@pytest.mark.parametrize("layers,stages,expected", [
    (4, 2, [2, 2]), (5, 2, [3, 2]), (4, 4, [1, 1, 1, 1]), (10, 4, [2, 3, 3, 2]), (7, 3, [2, 3, 2]), (3, 3, [1, 1, 1]),
])
def test_uniform_split_puts_extra_layers_in_the_middle_first(layers, stages, expected):
    assert uniform_layers(layers, stages) == expected


def test_llama_parts_and_stage_names():
    parts = model_parts(build(num_hidden_layers=4))
    assert parts.pre == ("model.embed_tokens",)
    assert parts.post == ("model.norm", "lm_head")
    assert parts.shared == ("model.rotary_emb",)
    assert (parts.layers_fqn, parts.num_layers) == ("model.layers", 4)
    first, last = split_stages(parts, 2)
    assert first.modules == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.rotary_emb"]
    assert last.modules == ["model.layers.2", "model.layers.3", "model.rotary_emb", "model.norm", "lm_head"]


def test_gpt2_parts_inferred_from_the_module_tree():
    from transformers import AutoModelForCausalLM, GPT2Config

    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64))
    parts = model_parts(model)
    assert parts.pre == ("transformer.wte", "transformer.wpe")
    assert parts.post == ("transformer.ln_f", "lm_head")
    assert "transformer.drop" in parts.shared


def test_explicit_layer_list():
    specs = split_stages(model_parts(build(num_hidden_layers=5)), 2, [1, 4])
    assert [s.layers for s in specs] == [[0], [1, 2, 3, 4]]


@pytest.mark.parametrize("counts,message", [
    ([2, 2, 1], "lists 3 stages but pp_size \\* pp_virtual_stages = 2"),
    ([2, 2], "sums to 4, but the model has 5 layers"),
    ([6, -1], "none may be negative"),
])
def test_bad_layer_lists(counts, message):
    with pytest.raises(ValueError, match=message):
        split_stages(model_parts(build(num_hidden_layers=5)), 2, counts)


def test_middle_stage_without_layers_is_refused():
    with pytest.raises(ValueError, match="every middle stage needs at least one layer"):
        split_stages(model_parts(build(num_hidden_layers=4)), 3, [2, 0, 2])


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match="4 stages but the model has only 2 layers; use at most 2"):
        split_stages(model_parts(build(num_hidden_layers=2)), 4)


def test_model_without_a_layer_stack_cannot_be_split():
    class NoLayers(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(UnsplittableModel, match="NoLayers has no ModuleList of decoder layers.*pp_size=1"):
        model_parts(NoLayers())


def test_model_without_embedding_before_layers_cannot_be_split():
    class HeadOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
            self.head = nn.Linear(4, 4)

    with pytest.raises(UnsplittableModel, match="HeadOnly: found no embedding before layers"):
        model_parts(HeadOnly())


def test_stage_placement():
    assert stage_ids_for_rank(1, 4, 2, "loop") == [1, 5]
    assert stage_ids_for_rank(1, 4, 2, "v") == [1, 6]
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        stage_ids_for_rank(0, 2, 3, "v")


# ---- refused by prepare() before any collective (no process group exists in these tests)
def prepare_with(config, model, num_processes):
    plugin = NDParallelPlugin(config).attach(fake_accelerator(num_processes))
    return plugin.prepare(model)


def test_pp_size_greater_than_layers():
    with pytest.raises(ValueError, match="4 stages but the model has only 2 layers"):
        prepare_with(ParallelismConfig(pp_size=4, pp_microbatches=4), build(num_hidden_layers=2), 4)


def test_interleaved_stages_greater_than_layers():
    config = ParallelismConfig(pp_size=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=2)
    with pytest.raises(ValueError, match="4 stages but the model has only 3 layers"):
        prepare_with(config, build(num_hidden_layers=3), 2)


def test_too_few_microbatches_for_1f1b():
    config = ParallelismConfig(pp_size=4, pp_microbatches=2)
    with pytest.raises(ValueError, match="'1f1b' needs pp_microbatches >= pp_size.*gpipe"):
        prepare_with(config, build(num_hidden_layers=4), 4)


def test_batch_not_divisible_by_microbatches():
    from torch.utils.data import DataLoader

    plugin = NDParallelPlugin(ParallelismConfig(pp_size=2, pp_microbatches=4)).attach(fake_accelerator(2))
    with pytest.raises(ValueError, match="batch of 6 samples .* pp_microbatches=4"):
        plugin.prepare(DataLoader(list(range(24)), batch_size=6))


def test_layer_list_of_the_wrong_length_is_refused_by_the_config():
    with pytest.raises(ValueError, match=r"pp_balance=\[1, 1, 1\] has 3 entries.*2 stages"):
        ParallelismConfig(pp_size=2, pp_balance=[1, 1, 1])


def test_the_models_pp_plan_names_the_layer_stack():
    model = build(num_hidden_layers=2)
    # A longer ModuleList elsewhere would win the "longest list" guess; the pp_plan still names the layers.
    model.model.extra = nn.ModuleList([nn.Identity() for _ in range(5)])
    assert model_parts(model).layers_fqn == "model.layers"


def test_metadata_inference_calls_are_marked_and_see_fixed_values():
    """torch's pipelining runs a stage on torch.empty buffers to infer shapes; the pipeline's loss is told for the
    length of that call, and the stage swaps the buffer for fixed normal values (the chunked loss checks its head on
    that call). The methods are torch's private API: this fails when a torch release renames them."""
    from torch.distributed.pipelining import PipelineStage

    from nd_parallel.distributed.pipeline.stage import _not_garbage
    from nd_parallel.distributed.pipeline.torch_backend import METADATA_METHODS, mark_metadata_calls

    assert hasattr(PipelineStage, "_forward_metadata_inference") or hasattr(PipelineStage, "_shape_inference")

    class Loss:
        metadata_call = False

    loss, seen = Loss(), []

    class Stage:
        def _forward_metadata_inference(self, x):
            seen.append(loss.metadata_call)
            raise ValueError(x)

    stage = mark_metadata_calls(Stage(), loss)
    with pytest.raises(ValueError):
        stage._forward_metadata_inference(1)
    assert seen == [True] and loss.metadata_call is False and "_shape_inference" in METADATA_METHODS

    garbage = torch.full((2, 3, 4), float("nan"), requires_grad=True)
    fixed = _not_garbage(garbage)
    assert torch.isfinite(fixed).all() and torch.equal(fixed, _not_garbage(torch.empty(2, 3, 4)))
    fixed.sum().backward()  # still connected: torch infers the input gradient's metadata through it
    assert garbage.grad is not None and not garbage.grad.any()
    ids = torch.ones(2, 3, dtype=torch.long)
    assert _not_garbage(ids) is ids
