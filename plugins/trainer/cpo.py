"""TRL's ``CPOTrainer`` (1.16, ``trl.experimental.cpo``; Axolotl's ``rl: simpo`` runs it with ``loss_type="simpo"``)
under FSDP2 / HSDP / DDP / TP / CP / EP: its loss that of one process on the global batch.

CPOTrainer, like ORPOTrainer (orpo.py), runs the policy alone on the chosen and rejected sequences concatenated along
the batch and builds its loss from the whole logits:

    loss = mean over pairs of f(chosen, rejected) + cpo_alpha * NLL(chosen)

where f is the CPO / SimPO term of each pair's sequence log-probs (SimPO: their means over the answer tokens, with
the margin simpo_gamma) and NLL is ``nn.CrossEntropyLoss()``'s mean over the chosen *answer* tokens (labels != -100).
Here, as for ORPO: ``compute_loss`` rescales the rank's loss to its share of the mean over the global batch's pairs
(dpo.py's ``global_mean_loss``), and ``concatenated_forward`` returns the NLL times (local answer tokens / global
answer tokens) x (global pairs / local pairs), so the dp ranks' shares sum to the global token mean; under TP the
head's plan gathers the vocabulary, under CP the hooks gather the logits back into whole sequences with their
gradient. Refused before any collective (``refuse_trl_options``): pipeline parallelism and the MoE router's
auxiliary loss under dp or cp.
"""

from __future__ import annotations

from .dpo import is_trl_trainer, refuse_trl_options
from .orpo import PP_REASON, adopt_pair_loss


def is_cpo_trainer(trainer) -> bool:
    return is_trl_trainer(trainer, "CPOTrainer")


def check_cpo_args(trainer, config) -> None:
    refuse_trl_options(trainer, config, "CPOTrainer", [], pp_reason=PP_REASON)


def adopt_cpo(trainer, plugin) -> None:
    """Route this CPOTrainer's loss through the global-batch means (see the module docstring)."""
    check_cpo_args(trainer, plugin.config)
    # CPOTrainer's NLL targets: the chosen labels other than -100, shifted by one
    adopt_pair_loss(trainer, lambda batch: (batch["chosen_labels"][:, 1:] != -100).sum())
