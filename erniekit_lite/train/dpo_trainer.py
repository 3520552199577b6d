"""TRL's DPOTrainer on padding-free packed preference rows.

TRL 1.16 disables DPO `padding_free`. Rather than re-implement its losses (sigmoid, ipo, hinge, rpo_alpha, ...),
reference handling and metrics, we keep all of `DPOTrainer._compute_loss` and change only the forward it calls:
TRL calls `model(..., fused_lm_head=True)` and reads per-token log-probs in a padded [2B, L-1] layout. Our
forward runs the model once over the packed row (`packed_*` keys from `PackedPairCollator`, per-sample
attention, `use_cache=False`), scores only the trained positions, and scatters the per-token values into that
layout with `logp_index`. The reference pass (adapter disabled, or a frozen copy) goes through the same forward.
"""

from __future__ import annotations

import types

import torch
from trl import DPOTrainer
from trl.trainer.utils import FusedCausalLMOutput

from erniekit_lite.train.checkpoints import CheckpointMixin
from erniekit_lite.train.optimizer import LoraPlusMixin
from erniekit_lite.train.scoring import score
from erniekit_lite.train.trainer import HostBoundsMixin, ThroughputMixin



def add_packed_forward(model) -> None:
    """Wrap `model.forward` (already patched by TRL) so pair batches are scored by `pair_scores`."""
    inner = model.forward

    def forward(self, *args, fused_lm_head=False, **kwargs):
        if "logp_index" not in kwargs:  # generation, or TRL's own padded batches
            return inner(*args, fused_lm_head=fused_lm_head, **kwargs)
        return pair_scores(self, kwargs)

    model.forward = types.MethodType(forward, model)


def pair_scores(model, kwargs: dict) -> FusedCausalLMOutput:
    """Per-token scores of a pair batch (`scoring.score`), in the [2B, L-1] layout of TRL's DPO loss."""
    rows, width = kwargs["input_ids"].shape
    if "packed_input_ids" in kwargs:  # one padding-free sequence, per-sample attention
        labels = kwargs["packed_labels"]
        inputs = {
            "input_ids": kwargs["packed_input_ids"],
            "position_ids": kwargs["packed_position_ids"],
            **{k: kwargs[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")},
        }
    else:  # padded [2B, L] rows
        labels = kwargs["pair_labels"]
        inputs = {"input_ids": kwargs["input_ids"], "attention_mask": kwargs["attention_mask"]}
    inputs["output_router_logits"] = kwargs.get("output_router_logits", False)
    scores = score(model, labels, inputs)
    index = kwargs["logp_index"]

    def layout(values: torch.Tensor) -> torch.Tensor:
        flat = values.new_zeros(rows * (width - 1)).index_put((index,), values)
        return flat.view(rows, width - 1)

    token = scores.log_probs
    return FusedCausalLMOutput(
        loss=-token.sum() / max(1, token.numel()),
        log_probs=layout(token),
        entropy=layout(scores.entropy.detach()),
        log_sum_sq_probs=layout(scores.log_sum_sq_probs),
        mean_logits=layout(scores.mean_logits),
        is_top1=layout(scores.is_top1.to(token.dtype)).bool(),
        label_mask=layout(torch.ones_like(token)).bool(),
        aux_loss=scores.aux_loss,
    )


class ErnieDPOTrainer(CheckpointMixin, ThroughputMixin, HostBoundsMixin, LoraPlusMixin, DPOTrainer):
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

    def _set_signature_columns_if_needed(self):
        self._signature_columns = ["input_ids", "labels", "seq_lengths"]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        self.count_tokens(model, int(inputs["attention_mask"].sum()), inputs.pop("token_slots", 0))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
