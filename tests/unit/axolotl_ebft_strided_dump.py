"""Run by Axolotl's interpreter (.venv-axolotl) from test_ebft_strided.py: Axolotl 0.19's strided EBFT pieces
(axolotl/core/trainers/ebft/strided.py: its dense mask and position ids, its trainer's _compute_block_rewards and
_compute_advantages called on a stand-in trainer whose feature network returns the hidden states of spec.pt), saved
to out.pt.

    python axolotl_ebft_strided_dump.py spec.pt out.pt
"""

import sys
import types

import torch
from axolotl.core.trainers.ebft.strided import AxolotlStridedEBFTTrainer, build_strided_dense_mask_and_positions


class Hidden(torch.nn.Module):
    """A feature network that returns the given hidden states whatever it reads."""

    def __init__(self, hidden):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        return types.SimpleNamespace(hidden_states=self.hidden)


def main() -> None:
    spec = torch.load(sys.argv[1])
    out = {}
    for i, (length, anchor, steps, gen, stride, blocks) in enumerate(spec["masks"]):
        total = length + steps * blocks
        mask, positions = build_strided_dense_mask_and_positions(total, length, anchor, steps, gen, stride, blocks,
                                                                 torch.device("cpu"), 1, torch.float32)
        out[f"mask_{i}"], out[f"positions_{i}"] = mask[0, 0] == 0, positions[0]
    for name, case in spec["rewards"].items():
        s = case["settings"]
        trainer = types.SimpleNamespace(
            ebft_generate_max_len=s["generate_max_len"], ebft_stride=s["stride"], ebft_context_length=s["anchor"],
            _feature_device=torch.device("cpu"), _share_feature_weights=False,
            feature_network=Hidden(case["hidden"]), _feature_use_flex=False,
            feature_layer_indices=case["indices"], ebft_embed_method=s["embed_method"],
            ebft_use_whitening=s["use_whitening"], ebft_alignment_coef=s["alignment_coef"],
            ebft_diversity_coef=s["diversity_coef"], ebft_advantage_estimator=s["advantage_estimator"])
        docs, n, blocks, length = case["docs"], s["n_samples_per_prompt"], case["blocks"], case["length"]
        full = torch.zeros(docs * n, length + blocks * s["generate_max_len"], dtype=torch.long)
        rewards = AxolotlStridedEBFTTrainer._compute_block_rewards(
            trainer, full, None, torch.zeros_like(full), full[:, :length], blocks, docs, n, anchor_offset=s["anchor"])
        out[f"rewards_{name}"] = rewards
        out[f"advantages_{name}"] = AxolotlStridedEBFTTrainer._compute_advantages(trainer, rewards, docs, n, blocks)
        out[f"cfm_{name}"] = torch.tensor(trainer._last_cfm)
    torch.save(out, sys.argv[2])
    print("{}")


if __name__ == "__main__":
    main()
