"""TRL's DPOTrainer on padding-free packed preference rows.

TRL 1.16 disables DPO `padding_free`. Rather than re-implement its losses (sigmoid, ipo, hinge, rpo_alpha, ...),
reference handling and metrics, we keep all of `DPOTrainer._compute_loss` and change only the forward it calls:
TRL calls `model(..., fused_lm_head=True)` and reads per-token log-probs in a padded [2B, L-1] layout. Our
forward runs the model once over the packed row (`packed_*` keys from `PackedPairCollator`, per-sample
attention, `use_cache=False`), scores only the trained positions, and scatters the per-token values into that
layout with `logp_index`. The reference pass (adapter disabled, or a frozen copy) goes through the same forward.
"""

from __future__ import annotations

import torch
from trl import DPOTrainer

from erniekit_lite.train.checkpoints import CheckpointMixin
from erniekit_lite.train.optimizer import LoraPlusMixin
from erniekit_lite.train.pair_scoring import PairRowsMixin, add_packed_forward
from erniekit_lite.train.trainer import HostBoundsMixin, ThroughputMixin


class ErnieDPOTrainer(CheckpointMixin, ThroughputMixin, HostBoundsMixin, LoraPlusMixin, PairRowsMixin, DPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._install_packed_forward()

    def _install_packed_forward(self) -> None:
        # Called again from `_precompute_ref_logps`, which TRL runs inside `__init__`, after its own patching
        for model in (self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model, self.ref_model):
            if model is not None and not getattr(model, "_erniekit_packed", False):
                add_packed_forward(model)
                model._erniekit_packed = True

    def _precompute_ref_logps(self, dataset, name, batch_size):
        """Reference log-probs per pair, stored per row (a row holds whole pairs, in collator order)."""
        self._install_packed_forward()
        model = self.ref_model or self.model
        chosen, rejected = [], []
        for row in dataset:
            batch = self.data_collator([row])
            batch = {k: v.to(self.accelerator.device) if torch.is_tensor(v) else v for k, v in batch.items() if k != "token_slots"}
            c, r = self.compute_ref_log_probs(model, batch)
            chosen.append(c.float().cpu().tolist())
            rejected.append(r.float().cpu().tolist())
        return dataset.add_column("ref_chosen_logps", chosen).add_column("ref_rejected_logps", rejected)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset  # already tokenized and packed by erniekit_lite.data.pairs
