"""Per-token log-probabilities at trained positions only, without ever building [tokens x vocab] logits.

ERNIE 4.5's LM head has 103k rows, so for small models it is most of the compute, and full logits for an 8k-token
row take gigabytes. `model(..., score_labels=labels)` runs the backbone once, keeps the hidden states of positions
whose next token is trained, and scores them with TRL's chunked log-prob kernel (tiles of the vocabulary, with a
backward that recomputes each tile). SFT and DPO both read their losses and metrics from these scores.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from trl.kernels import ChunkedLogProbFunction

from erniekit_lite.data.tokenize import IGNORE

VOCAB_CHUNK = 8192  # vocabulary columns per tile
OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@dataclass
class Scores:
    log_probs: torch.Tensor  # [n] log-probability of each trained next token (differentiable)
    entropy: torch.Tensor  # [n]
    log_sum_sq_probs: torch.Tensor  # [n], no grad
    mean_logits: torch.Tensor  # [n], no grad
    is_top1: torch.Tensor  # [n] bool
    aux_loss: torch.Tensor | None  # MoE router load-balancing loss, when requested


def labelled_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [batch, seq] mask of the positions whose next token is trained, and those tokens (flat, row-major)."""
    targets = labels[:, 1:]
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = targets != IGNORE
    return keep, targets[keep[:, :-1]]


def add_scoring_forward(model) -> None:
    """Let `model(..., score_labels=labels)` return `Scores`; any other call is the model's own forward."""
    if getattr(model, "_erniekit_scoring", False):
        return
    inner = model.forward

    def forward(self, *args, score_labels=None, **kwargs):
        if score_labels is None:
            return inner(*args, **kwargs)
        return score(self, score_labels, kwargs)

    model.forward = types.MethodType(forward, model)
    model._erniekit_scoring = True


def score(model, labels: torch.Tensor, inputs: dict) -> Scores:
    moe = bool(inputs.pop("output_router_logits", False))
    for key in ("labels", "fused_lm_head", "use_cache", "logits_to_keep"):
        inputs.pop(key, None)
    keep, targets = labelled_positions(labels)
    out = model.base_model(**inputs, use_cache=False, **({"output_router_logits": True} if moe else {}))
    head = model.get_output_embeddings()
    log_probs, entropy, log_sum_sq, mean_logits, is_top1 = ChunkedLogProbFunction.apply(
        out.last_hidden_state[keep], head.weight, head.bias, targets, 1.0, VOCAB_CHUNK, None, 1.0, OUTPUTS
    )
    aux = None
    if moe:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        aux = load_balancing_loss_func(out.router_logits, model.config.moe_num_experts, model.config.moe_k, inputs.get("attention_mask"))
    return Scores(log_probs, entropy, log_sum_sq, mean_logits, is_top1, aux)
