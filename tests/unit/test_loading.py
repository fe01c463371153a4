"""Memory-efficient loading in one process (no process group): the meta build, key matching, dtypes, the
fallbacks to the plain path and the refusals. Each equality is bit for bit against a plain
``AutoModelForCausalLM.from_pretrained`` of the same directory with the same arguments."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nd_parallel import NDParallelPlugin
from nd_parallel.models.loading import PlainLoadNeeded, build_meta_model, lazy_checkpoint, load_local_shards
from nd_parallel.testing.models import save_tiny_model

CPU = torch.device("cpu")


def load_efficient(path, **kwargs):
    model = build_meta_model(path, **kwargs)
    assert all(p.is_meta for p in model.parameters()), "weights were read before prepare"
    report = load_local_shards([model], lazy_checkpoint(model), CPU)
    return model, report


def differences(plain, model) -> list[str]:
    """Names (parameters under every alias, and every buffer) whose dtype or bits differ."""
    def tensors(m):
        out = dict(m.named_parameters(remove_duplicate=False))
        out.update(m.named_buffers(remove_duplicate=False))
        return out

    a, b = tensors(plain), tensors(model)
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    assert len(a) > 0
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("loading_unit")


# llama/gemma/gemma3_text/gpt2: tied; gemma3_text: computed embed_scale buffer and two rotary embeddings;
# gpt2: learned positions; phi3, gpt_neox: fused qkv; olmo2: q/k norms.
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma", "gemma3_text", "gpt2", "phi3", "gpt_neox",
                                    "olmo2"])
def test_meta_build_then_full_read_equals_plain(family, root):
    path = save_tiny_model(family, root / family)
    plain = AutoModelForCausalLM.from_pretrained(path)
    model, report = load_efficient(path)
    # Non-persistent buffers (rotary inv_freq ...) are computed by __init__ on the CPU, not read, not garbage.
    assert not any(b.is_meta for b in model.buffers())
    if family != "gpt2":  # learned positions, no rotary buffer
        assert any(n.endswith("inv_freq") for n, _ in model.named_buffers())
    assert differences(plain, model) == []
    assert tied(model) == tied(plain)
    assert model.training == plain.training  # from_pretrained returns the model in eval mode
    assert report.bytes_read == report.bytes_total > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, "float16", "auto", None])
def test_requested_dtype_casts_like_transformers(dtype, root):
    path = save_tiny_model("qwen3", root / "qwen3_fp32")
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model, _ = load_efficient(path, dtype=dtype)
    assert differences(plain, model) == []
    assert model.get_input_embeddings().weight.dtype == plain.get_input_embeddings().weight.dtype


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_bf16_checkpoint_in_several_files(dtype, root):
    path = root / "llama_bf16_files"
    if not path.exists():
        source = save_tiny_model("llama", root / "llama_for_bf16")
        AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(path, max_shard_size="50KB")
    assert len(list(path.glob("*.safetensors"))) > 2 and (path / "model.safetensors.index.json").is_file()
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model, report = load_efficient(path, dtype=dtype)
    assert differences(plain, model) == []
    assert lazy_checkpoint(model) is None  # nothing left to read
    assert report.bytes_read == report.bytes_total


def test_base_model_checkpoint_and_key_mapping(root):
    """Keys that differ from module names: a base-model checkpoint (no 'model.' prefix, lm_head tied) and a
    user key_mapping, both resolved through transformers' own renaming."""
    full = AutoModelForCausalLM.from_pretrained(save_tiny_model("llama", root / "llama_for_base"))
    full.model.save_pretrained(root / "llama_base")  # keys: embed_tokens.weight, layers.0...
    plain = AutoModelForCausalLM.from_pretrained(root / "llama_base")
    model, _ = load_efficient(root / "llama_base")
    assert differences(plain, model) == [] and differences(full, model) == []

    renamed = root / "llama_renamed"
    renamed.mkdir()
    for name in ("config.json", "generation_config.json"):
        (renamed / name).write_bytes((root / "llama_for_base" / name).read_bytes())
    tensors = load_file(root / "llama_for_base" / "model.safetensors")
    save_file({k.replace("model.", "backbone.", 1): v for k, v in tensors.items()}, renamed / "model.safetensors",
              metadata={"format": "pt"})
    mapping = {r"^backbone\.": "model."}
    model, _ = load_efficient(renamed, key_mapping=mapping)
    assert differences(AutoModelForCausalLM.from_pretrained(renamed, key_mapping=mapping), model) == []
    assert differences(full, model) == []


def test_converted_weights_fall_back_to_plain_path(root, caplog):
    """MoE experts are merged by transformers on load: not sliceable as stored, so the plain path is taken."""
    path = save_tiny_model("mixtral", root / "mixtral", num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(PlainLoadNeeded, match="converted by transformers on load"):
        build_meta_model(path)
    with caplog.at_level(logging.WARNING, logger="nd_parallel"):
        model = NDParallelPlugin(dp_shard_size=2).from_pretrained(path)
    assert "memory-efficient loading does not apply" in caplog.text
    assert not any(p.is_meta for p in model.parameters()) and lazy_checkpoint(model) is None
    assert differences(AutoModelForCausalLM.from_pretrained(path), model) == []


def test_arguments_only_transformers_knows_fall_back(root, caplog):
    path = save_tiny_model("llama", root / "llama_args")
    with pytest.raises(PlainLoadNeeded, match="device_map"):
        build_meta_model(path, device_map="cpu")
    with pytest.raises(PlainLoadNeeded, match="not a local directory"):
        build_meta_model(root / "no_such_dir")
    plugin = NDParallelPlugin(dp_shard_size=2)
    assert lazy_checkpoint(plugin.from_pretrained(path, memory_efficient=False)) is None
    assert lazy_checkpoint(plugin.from_pretrained(path)) is not None
    # A config attribute is an override, as in from_pretrained, not a reason to fall back.
    model = build_meta_model(path, attention_dropout=0.25)
    assert model.config.attention_dropout == 0.25


def test_trust_remote_code_only_when_asked(root, monkeypatch):
    from transformers import AutoConfig

    seen = []
    original = AutoConfig.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoConfig, "from_pretrained", classmethod(spy))
    path = save_tiny_model("llama", root / "llama_trust")
    build_meta_model(path)
    assert seen == [False]


def test_missing_parameter_is_an_error_not_garbage(root):
    path = save_tiny_model("qwen3", root / "qwen3_missing")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"not in the checkpoint \(first: 'model.layers.1.mlp.down_proj.weight'\)"):
        build_meta_model(path)


def test_checkpoint_of_another_shape_is_refused(root):
    path = save_tiny_model("llama", root / "llama_other", intermediate_size=96)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 128
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"shape \(96, 64\) in the checkpoint, the model expects \(128, 64\)"):
        build_meta_model(path)


def test_missing_shard_file_is_refused(root):
    path = root / "llama_missing_file"
    AutoModelForCausalLM.from_pretrained(save_tiny_model("llama", root / "llama_src")).save_pretrained(
        path, max_shard_size="100KB")
    victim = sorted(path.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        build_meta_model(path)


def test_truncated_shard_is_refused(root):
    path = root / "llama_truncated"
    AutoModelForCausalLM.from_pretrained(save_tiny_model("llama", root / "llama_src2")).save_pretrained(
        path, max_shard_size="100KB")
    victim = sorted(path.glob("*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=f"{victim.name} is not a readable safetensors file"):
        build_meta_model(path)


def test_bin_only_checkpoint_is_not_unpickled(root):
    path = save_tiny_model("llama", root / "llama_bin")
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    with pytest.raises(PlainLoadNeeded):
        build_meta_model(path)
    with pytest.raises(OSError):  # the plain path is asked for safetensors only
        NDParallelPlugin(dp_shard_size=2).from_pretrained(path)


def test_single_process_prepare_and_step_equal_plain(root):
    """num_processes == 1: prepare reads the whole checkpoint; the optimizer built on the meta model trains."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    path = save_tiny_model("llama", root / "llama_single")
    ids = torch.randint(1, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    losses, models = [], []
    try:
        for efficient in (True, False):
            accelerator = Accelerator(cpu=True)
            plugin = NDParallelPlugin().attach(accelerator)
            model = plugin.from_pretrained(path, memory_efficient=efficient)
            assert all(p.is_meta for p in model.parameters()) == efficient
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model, opt = accelerator.prepare(model, opt)
            out = model(input_ids=ids, labels=ids)
            accelerator.backward(out.loss)
            opt.step()
            losses.append(out.loss.item())
            models.append(model)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert losses[0] == losses[1]
    assert differences(models[1], models[0]) == []  # equal after the step too: the optimizer held the real weights


def test_unexpected_keys_are_skipped_with_a_warning(root, caplog):
    path = save_tiny_model("llama", root / "llama_extra")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # stale buffer of old checkpoints
    tensors["model.extra_head.weight"] = torch.ones(3, 3)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="nd_parallel"):
        model, report = load_efficient(path)
    assert "1 checkpoint tensors have no place in LlamaForCausalLM" in caplog.text
    assert "'model.extra_head.weight'" in caplog.text
    assert differences(AutoModelForCausalLM.from_pretrained(path), model) == []
    assert report.bytes_read == report.bytes_total  # the unexpected ones are neither read nor counted


def test_only_placements_that_leave_one_box_are_read():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from nd_parallel.models.loading import check_one_box

    check_one_box((_StridedShard(0, split_factor=2), Shard(0)), (2, 2))  # FSDP over a colwise TP weight
    check_one_box((Replicate(), _StridedShard(0, split_factor=2), Shard(0)), (2, 2, 2))  # HSDP over TP
    check_one_box((Shard(0), Shard(1)), (2, 2))  # FSDP over a rowwise TP weight
    with pytest.raises(NotImplementedError, match="one contiguous box"):
        check_one_box((Shard(0), _StridedShard(0, split_factor=2)), (2, 2))  # every other row: not a box
    with pytest.raises(NotImplementedError, match="one contiguous box"):
        check_one_box((_StridedShard(0, split_factor=4), Shard(0)), (2, 2))


def test_reads_in_small_blocks_equal_one_read(root, monkeypatch):
    """Reads go in row blocks, each file mapping released before the next; the result must not depend on it."""
    import nd_parallel.models.loading as loading

    opened = []
    real = loading.safe_open

    def counting(*args, **kwargs):
        opened.append(args[0])
        return real(*args, **kwargs)

    path = save_tiny_model("qwen3", root / "qwen3_blocks", intermediate_size=102)
    monkeypatch.setattr(loading, "READ_BLOCK_BYTES", 1000)  # 2-3 rows of the fp32 matrices per block
    monkeypatch.setattr(loading, "safe_open", counting)
    model, report = load_efficient(path)
    assert report.bytes_read == report.bytes_total
    assert len(opened) > 3 * report.tensors  # many blocks per matrix
    assert differences(AutoModelForCausalLM.from_pretrained(path), model) == []


def test_meta_build_makes_read_parameters_trainable_as_from_pretrained(root):
    """Marian builds its sinusoidal position table frozen (``_freeze=True``), and transformers' from_pretrained makes
    every floating-point parameter it reads trainable: the meta build gives the same flags, so a layout trains
    the same parameters as one process."""
    from nd_parallel.testing.tiny_configs import tiny_sweep_config

    path = root / "marian_flags"
    AutoModelForCausalLM.from_config(tiny_sweep_config("marian")).save_pretrained(path)
    plain = AutoModelForCausalLM.from_pretrained(path)
    flags = {n: p.requires_grad for n, p in plain.named_parameters()}
    assert flags["model.decoder.embed_positions.weight"]
    assert {n: p.requires_grad for n, p in build_meta_model(path).named_parameters()} == flags
