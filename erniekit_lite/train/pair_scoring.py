"""Preference pair rows scored in one packed forward: what DPO (dpo_loss.py), KTO (kto.py) and the reference-free
ORPO / SimPO (reference_free.py) share.

`PackedPairCollator` (data/pairs.py) gives a batch both ways: the packed sequence the model runs on (`packed_*`,
per-sample attention, `use_cache=False`) and a padded [2B, L] layout (chosen rows first, TRL's). `pair_scores` runs
the model once over the packed row, scores only the trained positions (`scoring.score`), and scatters the per-token
values into the [2B, L-1] layout with `logp_index` (no boolean mask, so no size read back); each loss reads its
per-sequence sums or means there.
"""

from __future__ import annotations

import torch
from dataclasses import dataclass

from erniekit_lite.data.sequence_shard import CUT_KEYS
from erniekit_lite.train.scoring import score


@dataclass
class PairScores:
    """Per-token values of a pair batch in the [2B, L-1] layout (chosen rows first), 0 where nothing is scored."""

    log_probs: torch.Tensor  # differentiable on the policy's pass
    entropy: torch.Tensor  # no grad, as the rest
    log_sum_sq_probs: torch.Tensor
    mean_logits: torch.Tensor
    is_top1: torch.Tensor  # bool
    mask: torch.Tensor  # bool: the scored (trained) positions
    aux_loss: torch.Tensor | None  # MoE router load-balancing loss, when requested


def pair_scores(model, kwargs: dict) -> PairScores:
    """Per-token scores of a pair batch (`scoring.score`), in the [2B, L-1] layout."""
    rows, width = kwargs["input_ids"].shape
    if "packed_input_ids" in kwargs:  # one padding-free sequence, per-sample attention
        labels = kwargs["packed_labels"]
        inputs = {
            "input_ids": kwargs["packed_input_ids"],
            "position_ids": kwargs["packed_position_ids"],
            **{k: kwargs[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")},
        }
        for key in ("moe_mm_token_type_ids", "pixel_values", "image_grid_thw"):  # ERNIE-4.5-VL pairs (data/vl_rows.py)
            if f"packed_{key}" in kwargs:
                inputs[key] = kwargs[f"packed_{key}"]
    else:  # padded [2B, L] rows
        labels = kwargs["pair_labels"]
        inputs = {"input_ids": kwargs["input_ids"], "attention_mask": kwargs["attention_mask"]}
    inputs["output_router_logits"] = kwargs.get("output_router_logits", False)
    # the collator's, for `labels` (`collate.host_facts`), and a sequence-parallel cut's (data/sequence_shard.py)
    for key in ("score_positions", "score_targets", *CUT_KEYS):
        if key in kwargs:
            inputs[key] = kwargs[key]
    scores = score(model, labels, inputs)
    index = kwargs["logp_index"]

    def layout(values: torch.Tensor) -> torch.Tensor:
        flat = values.new_zeros(rows * (width - 1)).index_put((index,), values)
        return flat.view(rows, width - 1)

    token = scores.log_probs
    return PairScores(
        log_probs=layout(token),
        entropy=layout(scores.entropy.detach()),
        log_sum_sq_probs=layout(scores.log_sum_sq_probs),
        mean_logits=layout(scores.mean_logits),
        is_top1=layout(scores.is_top1.to(token.dtype)).bool(),
        mask=layout(torch.ones_like(token)).bool(),
        aux_loss=scores.aux_loss,
    )
