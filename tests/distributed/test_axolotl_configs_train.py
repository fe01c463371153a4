"""The test YAMLs of tests/axolotl_configs/ TRAIN on 2 CPU ranks under the layout each names (FSDP2, DDP, TP2, PP2,
CP2; a DeepSpeed json or FSDP1 list runs as FSDP2), each on a tiny local model of the family it names and synthetic
local data in the record format its dataset `type` expects: chat templates, Alpaca (and its other prompt styles,
Jeopardy), completion, pretraining, pre-tokenized records.

All runs share ONE 2-rank launch (2 optimizer steps each), built exactly as `nd-parallel train` builds them, with
the working directory at a folder that holds the YAMLs' relative paths (./models/<family>, ./data/..., as Axolotl
resolves them). Parity with one process is proven for these layouts by test_train_yaml_parity.py; here each config
must train: two finite logged losses, the model or adapter saved, frozen parameters (unfrozen_parameters) kept.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from nd_parallel.testing.models import make_text, save_tiny_model, write_mamba_ssm
from nd_parallel.testing.multimodal import save_tiny_mistral3, save_tiny_vlm, write_images
from nd_parallel.testing.tekken import write_tiny_tekken
from tests.distributed.train_yaml_helpers import jobs_for, logged, marker_tokens, run_jobs, saved_tensors

CONFIGS = Path(__file__).resolve().parent.parent / "axolotl_configs"
# 41 of the 83 YAMLs (the others share a family and a path with one of these and are read by the unit tests): one
# launch of 2 ranks, 2 steps each, to keep the wall time of this file near 3 minutes on 2 CPU cores.
TRAINED = ["llama3_lora_fsdp2", "mistral_fsdp1_alpaca", "qwen25_chat_ddp", "qwen3_chat_tp2", "gemma_chat_fsdp2",
           "gemma3_chat_zero3", "phi3_chat_zero2", "cohere_chat", "olmo3_completion_pp2", "llama_jinja_file",
           "mixtral_unfrozen", "qwen3_moe_plugins", "lfm2_chatml", "mistral_tekken_chat", "chatml_pretraining",
           "qwen2_instruction_styles", "qwen3_moe_qlora_experts", "mistral_common_chat", "llama3_dpo_lora_fsdp2",
           "qwen3_qat_fsdp2", "llama3_kto_lora_cp2", "gemma3_eaft_text", "chatml_dpo_ultra_tp2",
           "chatml_orpo_lora_fsdp2", "llama_lisa_pp2", "llama_relora_fsdp2", "llava_vision_lora_fsdp2",
           "qwen2_reward_model_fsdp2", "qwen2_prm_lora_ddp", "mistral3_vision_mistral_common",
           "llama32_vision_lora_fsdp2", "mamba_completion_fsdp2", "llama_save_best_fsdp2",
           "phi3_causal_lm_eval_fsdp2", "llama3_gdpo_lora_fsdp2", "llama3_ebft_opencode_lora_fsdp2",
           "llama3_ebft_strided_lora_fsdp2", "llama3_ebft_strided_structured_ddp", "llama_relora_qlora_ddp",
           "mamba_ssm_alpaca_ddp", "qwen3_more_keys_fsdp2"]
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text", "phi3", "cohere", "olmo3", "mixtral",
            "qwen3_moe", "lfm2", "mamba")  # the families TRAINED names


def _write_workspace(root: Path) -> None:
    from nd_parallel.testing.tokenizer import train_tiny_tokenizer

    lines = make_text(160, seed=3)
    tokenizer = train_tiny_tokenizer(lines, vocab_size=180)
    tokenizer.add_special_tokens({"additional_special_tokens": marker_tokens()})
    assert len(tokenizer) <= 256, len(tokenizer)
    for family in FAMILIES:
        save_tiny_model(family, root / "models" / family, seed=1)
        tokenizer.save_pretrained(root / "models" / family)
    write_mamba_ssm(root / "models" / "mamba", root / "models" / "mamba_ssm")  # mamba_ssm's format, no tokenizer
    (root / "models" / "lfm2" / "chat_template.jinja").unlink(missing_ok=True)  # no template: the fallback applies
    config = json.loads((root / "models" / "lfm2" / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (root / "models" / "lfm2" / "tokenizer_config.json").write_text(json.dumps(config))
    # mistral_common_chat: a Mistral checkpoint that ships mistral-common's tekken.json (no HF tokenizer files)
    (root / "models" / "mistral_tekken").mkdir(parents=True)
    vocab = write_tiny_tekken(root / "models" / "mistral_tekken" / "tekken.json", lines)
    save_tiny_model("mistral", root / "models" / "mistral_tekken", seed=1, vocab_size=vocab,
                    max_position_embeddings=512)
    data = root / "data"
    data.mkdir()
    (data / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines[:120]))
    alpaca = [{"instruction": lines[i], "input": lines[i + 1] if i % 2 else "", "output": lines[i + 2]}
              for i in range(0, 120, 3)]
    (data / "alpaca.json").write_text(json.dumps(alpaca))
    jeopardy = [{"question": r["instruction"], "category": r["input"], "answer": r["output"]} for r in alpaca]
    (data / "jeopardy.json").write_text(json.dumps(jeopardy))
    tokenized = [tokenizer(t)["input_ids"] for t in lines[120:160]]  # Axolotl's `type:` left empty
    (data / "tokenized.jsonl").write_text("".join(json.dumps({"input_ids": ids, "labels": [-100] * 3 + ids[3:],
                                                              "attention_mask": [1] * len(ids)}) + "\n"
                                                  for ids in tokenized))
    share, msgs = [], []
    for i in range(0, 120, 4):
        turns = [("system", "be brief"), ("user", lines[i]), ("assistant", lines[i + 1]), ("user", lines[i + 2]),
                 ("assistant", lines[i + 3])]
        names = {"user": "human", "assistant": "gpt", "system": "system"}
        share.append({"conversations": [{"from": names[r], "value": c} for r, c in turns]})
        msgs.append({"messages": [{"role": r, "content": c} for r, c in turns[1:]]})  # alternating, no system
    (data / "chat_sharegpt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in share))
    (data / "chat_messages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in msgs))
    pairs = [{"conversation": [{"from": "human", "text": lines[i]}], "preferred": {"from": "bot", "text": lines[i + 1]},
              "dispreferred": lines[i + 2] if i % 2 else [{"from": "bot", "text": lines[i + 2]}]}
             for i in range(0, 120, 3)]
    (data / "preference.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs + pairs[:2]))  # 2 duplicates
    kto = [{"prompt": lines[i], "completion": lines[i + 1], "label": i % 3 == 0, **({"system": "be brief"} if i % 4
                                                                                    else {})} for i in range(0, 80, 2)]
    (data / "kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kto))
    ultra = [{"prompt": lines[i], "system": "be brief" if i % 3 else "", **{
        key: [{"role": "user", "content": lines[i]}, {"role": "assistant", "content": lines[i + j]}]
        for key, j in (("chosen", 1), ("rejected", 2))}} for i in range(0, 90, 3)]
    (data / "dpo_ultra.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ultra))
    argilla = [{"chosen": [{"role": "user", "content": lines[i]}, {"role": "assistant", "content": lines[i + 1]}],
                "rejected": [{"role": "user", "content": lines[i]}, {"role": "assistant", "content": lines[i + 2]}],
                **({"system": "be brief"} if i % 2 else {})} for i in range(0, 90, 3)]
    (data / "argilla.jsonl").write_text("".join(json.dumps(r) + "\n" for r in argilla))
    # llava_vision_lora_fsdp2: a tiny Llava with its processor, and image chat rows (an image path per first turn)
    save_tiny_vlm("llava", root / "models" / "llava", seed=1)
    save_tiny_mistral3(root / "models" / "mistral3", seed=1)  # its tekken.json encodes the images
    save_tiny_vlm("mllama", root / "models" / "mllama", seed=1)  # Llama 3.2 Vision
    images = write_images(data / "images", 4, seed=2)
    vision = [{"messages": [{"role": "user", "content": [{"type": "image", "path": f"data/images/{images[i % 4].name}"},
                                                         {"type": "text", "text": lines[i]}]},
                            {"role": "assistant", "content": lines[i + 1]}]} for i in range(0, 16, 2)]
    (data / "vision_chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in vision))
    pairs = [{"system": "be brief" if i % 2 else "", "input": lines[i], "chosen": lines[i + 1],
              "rejected": lines[i + 2]} for i in range(0, 90, 3)]  # reward_model: bradley_terry.chat_template
    (data / "bradley_terry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    steps = [{"prompt": lines[i], "completions": [lines[i + 1][:30], lines[i + 2][:30]], "labels": [True, i % 3 == 0]}
             for i in range(0, 90, 3)]  # process_reward_model: stepwise_supervised
    (data / "stepwise.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (root / "templates").mkdir()
    shutil.copy(CONFIGS / "turns.jinja", root / "templates" / "turns.jinja")
    shutil.copy(CONFIGS / "rwd.py", root / "rwd.py")  # rl: gdpo's transform and reward functions
    (data / "opencode.jsonl").write_text("".join(json.dumps(  # rl: ebft: OpenCodeInstruct-shaped records
        {"id": str(i), "input": lines[i], "output": lines[i + 1][:40], "domain": "code"}) + "\n" for i in range(20)))
    for config, rows in (("main", 20), ("socratic", 4)):  # a hub dataset folder, downloaded: a subfolder per config
        (data / "gsm8k" / config).mkdir(parents=True)
        (data / "gsm8k" / config / "train.jsonl").write_text("".join(json.dumps(
            {"question": lines[i], "answer": f"{lines[i + 1][:20]}\n#### {i % 7}"}) + "\n" for i in range(rows)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("axolotl_configs")
    _write_workspace(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)  # the YAMLs' relative paths start at the working directory, as in Axolotl
        for name in TRAINED:
            shutil.copy(CONFIGS / f"{name}.yml", root / f"{name}.yml")
        jobs = jobs_for([root / f"{name}.yml" for name in TRAINED], root / "work", nproc=2)
        run_jobs(jobs, root / "work", nproc=2, timeout=600)
    return root, {job.name: job for job in jobs}


@pytest.mark.parametrize("name", TRAINED)
def test_axolotl_config_trains_on_two_cpu_ranks(runs, name):
    root, jobs = runs
    out = Path(jobs[name].train.output_dir)
    losses = [row["loss"] for row in logged(out)]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), (name, losses)
    assert saved_tensors(out), f"{name}: nothing saved in {out}"


def test_unfrozen_parameters_train_only_those(runs):
    root, jobs = runs
    from safetensors.torch import load_file

    before = load_file(str(root / "models" / "mixtral" / "model.safetensors"))
    after = saved_tensors(jobs["mixtral_unfrozen"].train.output_dir)
    common = set(before) & set(after)  # the experts may be saved under another (fused) layout: compare the rest
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"} <= common
    changed = {k for k in common if not torch.equal(before[k], after[k])}
    assert "lm_head.weight" in changed and "model.embed_tokens.weight" in changed
    assert changed <= {"lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.gate.weight"}, changed


def test_lora_on_expert_tensors_trains(runs):
    """lora_target_parameters (peft's target_parameters) under FSDP2: the experts' adapters are saved and moved
    from their zero init (lora_B), with rsLoRA recorded in the adapter's config."""
    root, jobs = runs
    out = Path(jobs["qwen3_moe_plugins"].train.output_dir)
    experts_b = {k: v for k, v in saved_tensors(out).items() if ".mlp.experts." in k and "lora_B" in k}
    assert experts_b and all(v.abs().max() > 0 for v in experts_b.values()), sorted(experts_b)
    config = json.loads((out / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert config["use_rslora"] is True


def test_lora_on_quantized_expert_tensors_trains(runs):
    """quantize_moe_experts with lora_target_parameters under FSDP2: an adapter on each NF4 expert tensor (two nested
    ParamWrappers per experts module, gate_up_proj inside as on float experts), every one moved from its zero init,
    and the packed experts are not saved with the adapter."""
    root, jobs = runs
    saved = saved_tensors(Path(jobs["qwen3_moe_qlora_experts"].train.output_dir))
    experts_b = {k: v for k, v in saved.items() if ".mlp.experts." in k and "lora_B" in k}
    assert len(experts_b) == 4 and all(v.abs().max() > 0 for v in experts_b.values()), sorted(experts_b)
    config = json.loads((root / "models" / "qwen3_moe" / "config.json").read_text())
    rows = {k: v.shape[0] for k, v in experts_b.items()}  # lora_B's rows: the tensor's output features
    assert sorted(rows.values()) == sorted([2 * config["moe_intermediate_size"], config["hidden_size"]] * 2)
    assert all(n == 2 * config["moe_intermediate_size"] for k, n in rows.items() if ".experts.base_layer." in k)
    assert not [k for k in saved if "parametrizations" in k]


def test_save_strategy_best_keeps_the_improving_evaluations(runs):
    """save_strategy: best with metric_for_best_model: loss under FSDP2: a checkpoint exactly at the steps whose
    evaluation loss is a new minimum (and not at the others)."""
    root, jobs = runs
    out = Path(jobs["llama_save_best_fsdp2"].train.output_dir)
    evals = {row["step"]: row["eval_loss"] for row in logged(out, "eval_log.jsonl")}
    best = [s for s in sorted(evals) if evals[s] < min([evals[t] for t in evals if t < s], default=math.inf)]
    saved = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert sorted(evals) == [1, 2] and saved == best, (evals, saved)
    assert len(best) < len(evals), evals  # the recipe has an evaluation that does not improve: nothing saved there


def test_causal_lm_eval_under_fsdp2_equals_one_process(runs):
    """do_causal_lm_eval under FSDP2: the generation metrics of the last evaluation (after step 2: the saved model's
    weights) equal the same metrics computed in one process from the saved model on the same evaluation split, and
    the predictions score something (the references are not empty)."""
    from transformers import AutoModelForCausalLM

    from nd_parallel.cli.train import lm_eval
    from nd_parallel.cli.train.data import load_prepared

    root, jobs = runs
    job = jobs["phi3_causal_lm_eval_fsdp2"]
    out = Path(job.train.output_dir)
    rows = [row for row in logged(out, "eval_log.jsonl") if "eval_perplexity" in row]
    assert [row["step"] for row in rows] == [2], rows
    _, evals, tokenizer = load_prepared(job.prepared)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    pairs = lm_eval.split_rows(evals, tokenizer.pad_token_id)
    references = [tokenizer.decode(r, skip_special_tokens=True) for _, r in pairs]
    assert len(pairs) == len(evals) and all(references), references
    predictions = lm_eval.generate(model, [p for p, _ in pairs], 8, tokenizer, 0, 1)
    want = lm_eval.scores(["sacrebleu", "chrf", "ter"], predictions, references)
    want["eval_perplexity"] = lm_eval.perplexity(model, references, tokenizer, 8, 2)
    got = {k: rows[0][k] for k in want}
    print(f"\ncausal LM eval under FSDP2 {got}, one process {want}")
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (got, want)


def test_mistral_common_run_keeps_its_tokenizer(runs):
    """tokenizer_use_mistral_common: the ranks read the prepared mistral-common tokenizer and the saved model
    carries its tekken.json (what AutoTokenizer reads back with mistral-common)."""
    root, jobs = runs
    out = Path(jobs["mistral_common_chat"].train.output_dir)
    assert (out / "tekken.json").read_bytes() == (root / "models" / "mistral_tekken" / "tekken.json").read_bytes()


def test_dpo_run_starts_at_the_reference(runs):
    """rl: dpo: LoRA's B starts at zero, so the policy equals the reference (the adapter disabled) at step 1 and
    DPO's sigmoid loss is exactly ln 2; the held-out pairs are evaluated."""
    root, jobs = runs
    out = Path(jobs["llama3_dpo_lora_fsdp2"].train.output_dir)
    losses = [row["loss"] for row in logged(out)]
    assert abs(losses[0] - math.log(2)) < 1e-6 and losses[1] != losses[0], losses
    assert (out / "eval_log.jsonl").is_file()


def test_gdpo_run_scores_and_moves(runs):
    """rl: gdpo under FSDP2: the prompts are rwd.gsm8k_transform's rows of the local hub folder's configuration
    "main" (its first 80%: 16 of 20), both reward functions are logged, completions differ within a group (a
    non-zero spread, else every advantage is 0) and the adapter moved. Parity with one process:
    test_train_grpo.py."""
    from nd_parallel.cli.train.data import load_prepared

    root, jobs = runs
    job = jobs["llama3_gdpo_lora_fsdp2"]
    rows = load_prepared(job.prepared)[0]
    assert len(rows) == 16 and rows[0]["prompt"][-1]["role"] == "user" and "answer" in rows.column_names
    log = logged(job.train.output_dir)
    assert all("rewards/format_reward/mean" in r and "rewards/correctness_reward/mean" in r for r in log), log
    assert any(r["reward_std"] > 0 for r in log), log
    assert any(v.abs().max() > 0 for k, v in saved_tensors(job.train.output_dir).items() if "lora_B" in k)


def test_ebft_run_matches_features(runs):
    """rl: ebft under FSDP2 with use_vllm: true (transformers generates): the prompts are Axolotl's ebft_opencode
    rows (16 of 20: split train[:16]), the feature-matching reward and its parts are logged, completions score
    differently within a group, and the adapter moved. Parity with one process: test_train_grpo.py."""
    from nd_parallel.cli.train.data import load_prepared

    root, jobs = runs
    job = jobs["llama3_ebft_opencode_lora_fsdp2"]
    rows = load_prepared(job.prepared)[0]
    assert len(rows) == 16 and sorted(rows.column_names) == ["ground_truth", "prompt"]
    log = logged(job.train.output_dir)
    assert all(k in r for r in log for k in ("ebft/alignment", "ebft/diversity", "ebft/cfm_loss")), log
    assert any(r["reward_std"] > 0 for r in log), log
    assert any(v.abs().max() > 0 for k, v in saved_tensors(job.train.output_dir).items() if "lora_B" in k)


def test_strided_ebft_runs_train_on_documents(runs):
    """rl: ebft, mode: strided under FSDP2 (raw documents) and DDP (prompt / completion records, anchors after the
    prompt): the rows are tokenized documents padded to sequence_len, several blocks are rolled out per document,
    their rewards and advantages are logged, and the adapter moved. Parity with one process:
    test_train_ebft_strided.py."""
    from nd_parallel.cli.train.data import load_prepared

    root, jobs = runs
    for name, columns in (("llama3_ebft_strided_lora_fsdp2", ["input_ids", "labels"]),
                          ("llama3_ebft_strided_structured_ddp", ["input_ids", "labels", "prompt_length"])):
        job = jobs[name]
        rows = load_prepared(job.prepared)[0]
        assert sorted(rows.column_names) == columns and {len(r) for r in rows["input_ids"]} == {48}, name
        log = logged(job.train.output_dir)
        assert all(r["ebft/num_blocks"] >= 2 and r["ebft/advantages_std"] > 0 for r in log), (name, log)
        assert any(v.abs().max() > 0 for k, v in saved_tensors(job.train.output_dir).items() if "lora_B" in k)
    structured = logged(jobs["llama3_ebft_strided_structured_ddp"].train.output_dir)
    assert all(r["ebft/anchor_offset"] > 4 and r["ebft/ce_loss"] > 0 for r in structured), structured


def test_orpo_run_is_evaluated(runs):
    """rl: orpo: the held-out pairs are evaluated (ORPOTrainer's own prediction step) and the adapter moved."""
    root, jobs = runs
    out = Path(jobs["chatml_orpo_lora_fsdp2"].train.output_dir)
    evals = logged(out, "eval_log.jsonl")
    assert evals and all(math.isfinite(row["eval_loss"]) for row in evals), evals
    assert any(v.abs().max() > 0 for k, v in saved_tensors(out).items() if "lora_B" in k)


def test_kto_run_starts_at_the_reference(runs):
    """rl: kto: at step 1 the LoRA policy equals the reference, so every log-ratio and the KL estimate are 0 and each
    example's loss is 1 - sigmoid(0) = 0.5 times its label's weight (kto_desirable_weight 2.0, undesirable 1.0).
    KTOTrainer reads the records in order (its sequential sampler; one file, no shuffle, no split), and under CP2
    the first step's batch is records 0 and 1 of data/kto.jsonl: desirable, undesirable -> 0.5 * (2 + 1) / 2."""
    root, jobs = runs
    out = Path(jobs["llama3_kto_lora_cp2"].train.output_dir)
    losses = [row["loss"] for row in logged(out)]
    first = [json.loads(line)["label"] for line in (root / "data" / "kto.jsonl").read_text().splitlines()[:2]]
    assert first == [True, False]
    assert abs(losses[0] - 0.75) < 1e-6, losses
    assert losses[1] != losses[0] and all(map(math.isfinite, losses)), losses


def test_lisa_run_trains_only_the_drawn_layers(runs):
    """lisa_n_layers: 1 of 2, drawn before each of the 2 steps (seeded by seed and step): under PP2 every layer drawn
    at least once moved, a layer never drawn is saved as loaded; the embeddings (outside the stack) train."""
    from safetensors.torch import load_file

    from nd_parallel.plugins.trainer.lisa import draw_layers

    root, jobs = runs
    before = load_file(str(root / "models" / "llama" / "model.safetensors"))
    after = saved_tensors(jobs["llama_lisa_pp2"].train.output_dir)
    drawn = {i for step in (0, 1) for i in draw_layers(7, step, 2, 1)}
    for i in range(2):
        key = f"model.layers.{i}.self_attn.q_proj.weight"
        assert torch.equal(before[key], after[key]) == (i not in drawn), (i, drawn)
    assert not torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])


def test_relora_run_saves_the_merged_model(runs):
    """relora: the restart before step 1 merged step 0's adapter into the base, and the run saves the merged model
    (no adapter files), whose projection weights moved from the checkpoint's."""
    from safetensors.torch import load_file

    root, jobs = runs
    out = Path(jobs["llama_relora_fsdp2"].train.output_dir)
    before = load_file(str(root / "models" / "llama" / "model.safetensors"))
    after = saved_tensors(out)
    assert not (out / "adapter_config.json").exists() and not any("lora_" in k for k in after), sorted(after)[:4]
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(before[key], after[key])
    # on a 4-bit base (llama_relora_qlora_ddp): the merged float model (relora_quantized.py), not 4-bit codes
    out = Path(jobs["llama_relora_qlora_ddp"].train.output_dir)
    merged = saved_tensors(out)
    assert set(merged) == set(before) and "quantization_config" not in json.loads((out / "config.json").read_text())
    assert merged[key].dtype == torch.float16 and not torch.equal(merged[key], before[key].half())
    assert (out / "relora_base" / "step-1" / "done.json").is_file()


def test_mamba_ssm_checkpoint_trains_as_the_transformers_port(runs):
    """model_type: MambaLMHeadModel with a checkpoint in mamba_ssm's format: the parent converted it (the ranks
    loaded transformers' MambaForCausalLM from the converted folder) and the trained model is saved in that format,
    its weights moved from the checkpoint's."""
    root, jobs = runs
    job = jobs["mamba_ssm_alpaca_ddp"]
    assert job.train.model_type == "MambaForCausalLM" and job.train.base_model.endswith("mamba-hf")
    out = Path(job.train.output_dir)
    assert json.loads((out / "config.json").read_text())["model_type"] == "mamba"
    before = torch.load(root / "models" / "mamba_ssm" / "pytorch_model.bin", weights_only=True)
    after = saved_tensors(out)
    key = "backbone.layers.0.mixer.in_proj.weight"
    assert after[key].shape == before[key].shape and not torch.equal(after[key], before[key])


def test_reward_models_train_their_heads(runs):
    """reward_model: the full model is saved with its trained one-output score head, and the held-out pairs are
    evaluated; process_reward_model (LoRA): the adapter carries the two-label head in full (peft's TOKEN_CLS task
    saves it), moved from the checkpoint's seeded init."""
    root, jobs = runs
    rm = Path(jobs["qwen2_reward_model_fsdp2"].train.output_dir)
    assert saved_tensors(rm)["score.weight"].shape[0] == 1
    assert (rm / "eval_log.jsonl").is_file()
    prm = saved_tensors(jobs["qwen2_prm_lora_ddp"].train.output_dir)
    heads = [v for k, v in prm.items() if "score" in k and k.endswith("weight")]
    assert heads and all(h.shape[0] == 2 for h in heads), sorted(prm)


def test_later_keys_act_in_one_run(runs):  # the constant tail (floor from step 1), test_datasets, trainable rows
    out = Path(runs[1]["qwen3_more_keys_fsdp2"].train.output_dir)
    assert [r["lr"] for r in logged(out)] == pytest.approx([1e-4, 1e-5], rel=1e-9)
    assert [r["step"] for r in logged(out, "eval_log.jsonl")] == [1, 2]
    assert any("trainable_tokens_delta" in k for k in saved_tensors(out))
