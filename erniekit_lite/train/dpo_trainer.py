"""TRL's DPOTrainer on padding-free packed preference rows.

TRL 1.16 disables DPO `padding_free`. Rather than re-implement its losses (sigmoid, ipo, hinge, rpo_alpha, ...),
reference handling and metrics, we keep all of `DPOTrainer._compute_loss` and change only the forward it calls:
TRL calls `model(..., fused_lm_head=True)` and reads per-token log-probs in a padded [2B, L-1] layout. Our
forward runs the model once over the packed row (`packed_*` keys from `PackedPairCollator`, per-sample
attention, `use_cache=False`), scores only the trained positions, and scatters the per-token values into that
layout with `logp_index`. The reference pass (adapter disabled, or a frozen copy) goes through the same forward.
"""

from __future__ import annotations

from trl import DPOTrainer

from erniekit_lite.model.lora import unwrap
from erniekit_lite.train import scored
from erniekit_lite.train.step_weights import PairTrainer


class ErnieDPOTrainer(PairTrainer, DPOTrainer):
    def __init__(self, *args, reference_cache: bool = True, **kwargs):
        self.reference_cache = reference_cache  # read by the reference precompute, which runs inside TRL's __init__
        super().__init__(*args, **kwargs)
        self._score_ourselves()

    def _score_ourselves(self) -> None:
        # Called again from `_precompute_ref_logps`, which TRL runs inside `__init__`, after its own fused head went on
        policy = unwrap(self.model)
        scored.instead_of_trl_head(policy, self.ref_model)  # a reference TRL built gets our class too
        if "sft" in getattr(self, "loss_types", ()):  # a per-token term: weighed by the step's chosen tokens (step_weights.py)
            weight = self.loss_weights[self.loss_types.index("sft")]
            policy.on_chosen_nll = lambda value: setattr(self, "_token_term", (weight, value))

    def _precompute_ref_logps(self, dataset, name, batch_size):
        """Reference log-probs per pair, stored per row (a row holds whole pairs, in collator order); sharded over
        the processes and cached (reference_logps.py)."""
        from erniekit_lite.train import reference_logps

        self._score_ourselves()

        def score(model, batch):
            chosen, rejected = self.compute_ref_log_probs(model, batch)
            return {"ref_chosen_logps": chosen, "ref_rejected_logps": rejected}

        return reference_logps.precompute(self, dataset, name, batch_size, score, per_row=lambda row: len(row["seq_lengths"]) // 2,
                                          settings={"method": "dpo", "ld_alpha": self.ld_alpha})

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset  # already tokenized and packed by erniekit_lite.data.pairs
