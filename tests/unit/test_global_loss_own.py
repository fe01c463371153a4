"""Models that compute their own cross-entropy on unshifted labels (distributed/loss.own_loss_unshifted)."""

import pytest
import torch.nn as nn


def _bare(cls):
    model = cls.__new__(cls)
    nn.Module.__init__(model)
    return model


@pytest.mark.parametrize("name,expected", [("BartForCausalLM", True), ("BlenderbotForCausalLM", True),
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
