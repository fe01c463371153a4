"""Models that compute their own cross-entropy on unshifted labels (distributed/loss.own_loss_unshifted)."""

import pytest
import torch.nn as nn


def _bare(cls):
    model = cls.__new__(cls)
    nn.Module.__init__(model)
    return model


@pytest.mark.parametrize("name,expected", [("BartForCausalLM", True), ("BlenderbotForCausalLM", True),
                                           ("CpmAntForCausalLM", True),
                                           ("LlamaForCausalLM", False), ("GPT2LMHeadModel", False)])
def test_own_unshifted_loss_is_found_from_the_forward(name, expected):
    import transformers

    from nd_parallel.distributed.loss import own_loss_unshifted

    assert own_loss_unshifted(_bare(getattr(transformers, name))) is expected


def test_pipeline_refuses_an_own_unshifted_loss_before_any_collective():
    from transformers import AutoModelForCausalLM

    from nd_parallel import ParallelismConfig
    from nd_parallel.distributed.pipeline import validate_pipeline
    from nd_parallel.models.hf import UnsplittableModel
    from nd_parallel.testing.tiny_configs import tiny_sweep_config

    model = AutoModelForCausalLM.from_config(tiny_sweep_config("bart"))
    with pytest.raises(UnsplittableModel, match="unshifted labels.*use pp_size=1"):
        validate_pipeline(model, ParallelismConfig(pp_size=2))


def test_chunked_loss_leaves_an_own_unshifted_loss_alone():
    """cpmant takes logits_to_keep, so the chunked loss could run on it; its own loss counts the unshifted labels,
    and the chunked (shifted) one would be another loss: it keeps its own, equal to the plain model's."""
    import torch
    from transformers import AutoModelForCausalLM

    from nd_parallel.distributed.chunked_loss import ChunkedLoss
    from nd_parallel.testing.tiny_configs import tiny_sweep_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_sweep_config("cpmant"))
    ids = torch.randint(1, model.config.vocab_size, (2, 12))
    expected = model(input_ids=ids, labels=ids).loss
    chunked = ChunkedLoss(model, 4)
    assert not chunked.head.enabled
    assert torch.equal(model(input_ids=ids, labels=ids).loss, expected)


def test_an_own_loss_in_a_head_module_is_found():
    """XLM hands its labels to ``pred_layer``, whose forward computes the unshifted cross-entropy; ProphetNet's
    forward calls its own ``_compute_loss`` (an NLL over every label token)."""
    from transformers import AutoModelForCausalLM

    from nd_parallel.distributed.loss import own_loss_unshifted
    from nd_parallel.testing.tiny_configs import tiny_sweep_config

    assert own_loss_unshifted(AutoModelForCausalLM.from_config(tiny_sweep_config("xlm")))
    assert own_loss_unshifted(AutoModelForCausalLM.from_config(tiny_sweep_config("prophetnet")))  # _compute_loss
    assert not own_loss_unshifted(AutoModelForCausalLM.from_config(tiny_sweep_config("llama")))
