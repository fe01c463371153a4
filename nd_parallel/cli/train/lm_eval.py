"""Axolotl's ``do_causal_lm_eval``: at each evaluation, generation metrics on the evaluation split, logged as
``eval_<metric>`` (and written to ``eval_log.jsonl``), with Axolotl 0.19's meaning (its
``CausalLMBenchEvalCallback``):

- each evaluation row (each packed sample, by ``position_ids``) splits into its prompt (the label-masked tokens,
  padding left out) and its reference (the trained tokens); the model continues the prompt greedily for up to
  ``eval_max_new_tokens`` tokens (Axolotl's default 128), and the prediction, the reference and the prompt are
  decoded without special tokens;
- ``eval_causal_lm_metrics`` (Axolotl's default: sacrebleu, comet, ter, chrf): ``sacrebleu``, ``chrf`` and ``ter``
  are corpus scores of the predictions against the references, computed with the ``sacrebleu`` package as
  Hugging Face ``evaluate``'s wrappers compute them (their defaults); ``perplexity`` is Axolotl's own: the
  references tokenized together (padded, truncated), the model's loss over windows of ``eval_max_new_tokens``
  tokens (stride 512), exp of the windows' mean loss. Its labels include the padding, as in Axolotl, so the value
  depends on the longest reference. ``comet`` needs the unbabel-comet package and a model from the hub: refused when
  named, left out of the default list with one line (Axolotl skips a metric it cannot load, with a warning).

Under a layout every rank of the model's forward must run the same forwards (FSDP2 all-gathers in each): each
rank reads the whole evaluation split (not its shard of the eval loader), generates its share of the rows one at a
time with exactly ``eval_max_new_tokens`` steps each (the end-of-sequence token cuts the decoded prediction, not
the loop; the share is padded to the same count on every rank), and the predictions are gathered; perplexity runs
the same batches on every rank. So the metrics do not depend on the layout: one process computes the same ones.
Where Axolotl takes rank 0's shard of the eval loader (its other ranks' rows are not scored) and re-tokenizes the
decoded prompts in right-padded batches, this generates from the prompt's tokens themselves. Generation needs the
whole model in each rank's forward: FSDP2 / HSDP / DDP; refused under TP, PP, CP and EP before any rank starts.
"""

from __future__ import annotations

from typing import Any

from .keys import model_splits
from .objective import evaluates
from .reward import reward_kind

METRICS = ("sacrebleu", "chrf", "ter", "perplexity")
AXOLOTL_DEFAULT = ("sacrebleu", "comet", "ter", "chrf")
STRIDE = 512  # Axolotl's Perplexity window stride


def refusals(d: dict, layout) -> list[str]:
    """Config stage: the metrics named, the layout, an evaluation to run at, and the package the scores need."""
    if not d.get("do_causal_lm_eval"):
        return []
    out, names = [], d.get("eval_causal_lm_metrics")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        return [f"eval_causal_lm_metrics={names!r}; write a list, e.g. [sacrebleu, chrf, perplexity]"]
    for name in names or []:
        if name == "comet":
            out.append("eval_causal_lm_metrics: comet needs the unbabel-comet package and its model from the hub, "
                       f"which nd-parallel train does not load; drop it (known: {', '.join(METRICS)})")
        elif name not in METRICS:
            out.append(f"eval_causal_lm_metrics: {name!r} is not a metric here; use {', '.join(METRICS)}")
    if d.get("rl") or reward_kind(d):
        out.append("do_causal_lm_eval with rl / a reward model: it scores a causal LM's generations (Axolotl adds it "
                   "to supervised fine-tuning only); drop it")
    split = model_splits(layout)
    if split:
        out.append(f"do_causal_lm_eval with {split}: generating needs the whole model in each rank's forward; use "
                   "dp_shard_size / dp_replicate_size (FSDP2, DDP)")
    if not evaluates(d):
        out.append("do_causal_lm_eval without an evaluation: the metrics are computed at each evaluation; set "
                   "val_set_size (e.g. 0.05) and eval_steps")
    tokens = d.get("eval_max_new_tokens")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        out.append(f"eval_max_new_tokens={tokens!r}: write an integer >= 1 (Axolotl's default 128)")
    if set(metric_names(names)) - {"perplexity"}:
        import importlib.util

        if importlib.util.find_spec("sacrebleu") is None:
            out.append("do_causal_lm_eval: sacrebleu, chrf and ter are computed with the sacrebleu package, which is "
                       "not installed: pip install sacrebleu (or nd_parallel[eval]), or list only perplexity")
    return out


def metric_names(names) -> list[str]:
    """The metrics computed: the list given, or Axolotl's default without comet."""
    return [n for n in (names or AXOLOTL_DEFAULT) if n != "comet"]


def note(d: dict) -> list[str]:
    if d.get("do_causal_lm_eval") and not d.get("eval_causal_lm_metrics"):
        return ["eval_causal_lm_metrics: Axolotl's default without comet (sacrebleu, ter, chrf): comet needs the "
                "unbabel-comet package and a hub model (Axolotl skips it too when it cannot load it)"]
    return []


def split_rows(dataset, pad_id: int | None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reference ids) per sample of the evaluation split: labels -100 and not padding -> prompt,
    labels kept -> reference; a packed row is cut where its position_ids restart (Axolotl's find_ranges)."""
    out = []
    for row in dataset:
        ids, labels = list(row["input_ids"]), list(row["labels"])
        positions = row.get("position_ids")
        starts = [i for i, p in enumerate(positions) if p == 0] if positions is not None else [0]
        for start, end in zip(starts, starts[1:] + [len(ids)]):
            if end - start < 2:  # Axolotl skips single-token ranges
                continue
            piece = range(start, end)
            prompt = [ids[i] for i in piece if labels[i] == -100 and ids[i] != pad_id]
            reference = [ids[i] for i in piece if labels[i] != -100]
            out.append((prompt, reference))
    return out


def share(n: int, rank: int, world: int) -> tuple[list[int], list[int]]:
    """(this rank's rows of n, in order; the rows it generates: those, then its last one again until every rank has
    the same count, since a forward under FSDP2 needs every rank)."""
    size = -(-n // world)
    mine = list(range(min(n, rank * size), min(n, (rank + 1) * size)))
    return mine, mine + [mine[-1] if mine else 0] * (size - len(mine))


def generate(model, prompts: list[list[int]], max_new_tokens: int, tokenizer, rank: int, world: int) -> list[str]:
    """Greedy continuations of this rank's share of ``prompts`` (every rank runs the same number of generations of
    exactly ``max_new_tokens`` steps), gathered on every rank in the prompts' order, cut at the end token."""
    import torch
    import torch.distributed as dist

    mine, runs = share(len(prompts), rank, world)
    device = next(p for p in model.parameters()).device
    eos = tokenizer.eos_token_id
    texts = []
    for i in runs:
        ids = torch.tensor([prompts[i] or [tokenizer.bos_token_id or eos or 0]], device=device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id or eos,
                                 use_cache=True)[0, ids.shape[1]:].tolist()
        if eos is not None and eos in out:  # the loop ran on (same steps on every rank); the text ends here
            out = out[:out.index(eos)]
        texts.append(tokenizer.decode(out, skip_special_tokens=True))
    texts = texts[:len(mine)]
    if world == 1:
        return texts
    every = [None] * world
    dist.all_gather_object(every, texts)
    return [t for part in every for t in part]


def perplexity(model, references: list[str], tokenizer, max_seq_len: int, batch: int) -> float:
    """Axolotl's Perplexity: the references tokenized together (padded, truncated), windows of max_seq_len tokens
    at stride 512, labels = the window's tokens (padding included) with the part already scored masked; exp of the
    windows' mean loss. Each window's loss is the mean over its batch; computed here in chunks of ``batch`` rows
    weighted by their label counts, the same mean."""
    import torch

    device = next(p for p in model.parameters()).device
    ids = tokenizer(references, return_tensors="pt", padding=True, truncation=True)["input_ids"].to(device)
    length, losses, prev_end = ids.shape[1], [], 0
    for begin in range(0, length, STRIDE):
        end = min(begin + max_seq_len, length)
        target = end - prev_end
        total, count = torch.zeros((), dtype=torch.float64), 0
        for rows in range(0, ids.shape[0], batch):
            window = ids[rows:rows + batch, begin:end]
            labels = window.clone()
            labels[:, :-target] = -100
            n = int((labels[:, 1:] != -100).sum())
            if n:
                with torch.no_grad():
                    total += model(input_ids=window, labels=labels).loss.double().cpu() * n
                count += n
        losses.append(total / max(count, 1))
        prev_end = end
        if end == length:
            break
    return float(torch.exp(torch.stack(losses).mean()))


def scores(names: list[str], predictions: list[str], references: list[str]) -> dict[str, float]:
    """sacrebleu / chrf / ter as evaluate's wrappers compute them (sacrebleu's defaults, one reference each)."""
    out: dict[str, float] = {}
    if not set(names) & {"sacrebleu", "chrf", "ter"}:
        return out
    import sacrebleu

    refs = [references]
    for name, metric in (("sacrebleu", sacrebleu.BLEU()), ("chrf", sacrebleu.CHRF()), ("ter", sacrebleu.TER())):
        if name in names:
            out[f"eval_{name}"] = float(metric.corpus_score(predictions, refs).score)
    return out


def callbacks(t, trainer) -> list:
    """[the Trainer callback that computes the metrics above at each evaluation] when ``t.do_causal_lm_eval``."""
    if not t.do_causal_lm_eval:
        return []
    return [callback(trainer, metric_names(t.eval_causal_lm_metrics), t.eval_max_new_tokens or 128)]


def callback(trainer, names: list[str], max_new_tokens: int):
    """The callback: the metrics on the whole evaluation split, logged through the Trainer (transformers imported
    here: the config stage does not need it)."""
    from transformers import TrainerCallback

    class CausalLMEval(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            tokenizer = trainer.processing_class
            model = trainer.model  # FSDP2 shards it in place; DDP's wrapper is not needed without gradients
            training = model.training
            model.eval()
            rows = split_rows(trainer.eval_dataset, tokenizer.pad_token_id)
            references = [tokenizer.decode(r, skip_special_tokens=True) for _, r in rows]
            results: dict[str, Any] = {}
            if set(names) - {"perplexity"}:
                accelerator = trainer.accelerator
                predictions = generate(model, [p for p, _ in rows], max_new_tokens, tokenizer,
                                       accelerator.process_index, accelerator.num_processes)
                results.update(scores(names, predictions, references))
            if "perplexity" in names:
                results["eval_perplexity"] = perplexity(model, references, tokenizer, max_new_tokens,
                                                        args.per_device_eval_batch_size)
            model.train(training)
            trainer.log(results)
            return control

    return CausalLMEval()
