"""Run by Axolotl's interpreter (.venv-axolotl) from test_ebft.py: Axolotl 0.19's own EBFT reward pieces
(axolotl/core/trainers/ebft/rewards.py and the arithmetic of its trainer's _feature_matching_reward) on the tensors
of spec.pt, saved to out.pt.

    python axolotl_ebft_dump.py spec.pt out.pt
"""

import sys

import torch
import torch.nn.functional as F
from axolotl.core.trainers.ebft.rewards import (
    apply_embed_method,
    get_alignment_rewards,
    get_diversity_rewards,
    whiten_embeddings_batched,
)


def rewards(gen_emb, gt_emb, groups, whitening, alignment_coef, diversity_coef):
    """The trainer's steps after pooling, as it writes them."""
    if whitening and gen_emb.shape[0] > 1:
        pairs = [whiten_embeddings_batched(gen_emb.view(-1, groups, gen_emb.shape[-1])[i], gt_emb[i:i + 1])
                 for i in range(gt_emb.shape[0])]
        gen_emb, gt_emb = torch.cat([g for g, _ in pairs]), torch.cat([t for _, t in pairs])
    else:
        gen_emb, gt_emb = F.normalize(gen_emb, p=2, dim=-1), F.normalize(gt_emb, p=2, dim=-1)
    alignment = get_alignment_rewards(gen_emb, gt_emb.repeat_interleave(groups, dim=0)) * 2
    diversity = get_diversity_rewards(gen_emb, groups) * 2
    mean_gen = gen_emb.view(-1, groups, gen_emb.shape[-1]).mean(dim=1)
    return alignment_coef * alignment - diversity_coef * diversity, ((mean_gen - gt_emb) ** 2).sum(dim=-1)


def main() -> None:
    spec = torch.load(sys.argv[1])
    out = {f"pool_{m}": apply_embed_method(spec["hidden"], m, spec["mask"], prompt_lengths=spec["prompt_lengths"])
           for m in ("last_token", "mean_pooling", "completion_mean", "concat")}
    for whitening in (False, True):
        out[f"rewards_{whitening}"], out[f"cfm_{whitening}"] = rewards(
            spec["generated"], spec["truth"], spec["groups"], whitening, 1.0, 0.5)
    torch.save(out, sys.argv[2])
    print("{}")


if __name__ == "__main__":
    main()
