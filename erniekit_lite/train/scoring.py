"""Per-token log-probabilities at trained positions only, with bounded LM-head memory.

ERNIE 4.5's LM head has 103k rows, so for small models it is most of the compute, and full logits for an 8k-token
row take gigabytes. `model(..., score_labels=labels)` runs the backbone once, keeps the hidden states of positions
whose next token is trained, and scores them in chunks of positions of at most `MAX_CHUNK_ELEMENTS` logits. When
there is more than one chunk, each is checkpointed (recomputed in backward), so peak memory stays at one chunk's
logits. (TRL's vocabulary-tiled kernel bounds memory too, but measured ~2x slower end to end on CPU.)
SFT and DPO both read their losses and metrics from these scores.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from erniekit_lite.data.tokenize import IGNORE

MAX_CHUNK_ELEMENTS = 2**27  # logits per chunk: 512 MiB in fp32 (about 1,300 positions of a 103k vocabulary)


@dataclass
class Scores:
    log_probs: torch.Tensor  # [n] log-probability of each trained next token (differentiable)
    entropy: torch.Tensor | None  # [n]; this and the next two only with `extras` (DPO's metrics read them)
    log_sum_sq_probs: torch.Tensor | None  # [n], no grad
    mean_logits: torch.Tensor | None  # [n], no grad
    is_top1: torch.Tensor  # [n] bool
    aux_loss: torch.Tensor | None  # MoE router load-balancing loss, when requested
    router_logits: tuple | None = None  # MoE: [tokens, experts] per MoE layer, when requested or tracked


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

    def forward(self, *args, score_labels=None, score_extras=False, **kwargs):
        if score_labels is None:
            return inner(*args, **kwargs)
        return score(self, score_labels, kwargs, score_extras)

    model.forward = types.MethodType(forward, model)
    model._erniekit_scoring = True


def score(model, labels: torch.Tensor, inputs: dict, extras: bool = True) -> Scores:
    """`extras` adds entropy, log-sum of squared probabilities and mean logit: three more passes over the logits."""
    moe = bool(inputs.pop("output_router_logits", False))
    tracker = getattr(model, "_expert_load", None)  # an ExpertLoad (expert_load.py) during MoE training
    routed = moe or tracker is not None
    for key in ("labels", "fused_lm_head", "use_cache", "logits_to_keep"):
        inputs.pop(key, None)
    keep, targets = labelled_positions(labels)
    out = model.base_model(**inputs, use_cache=False, **({"output_router_logits": True} if routed else {}))
    if tracker is not None and model.training and torch.is_grad_enabled():  # policy passes only, not the reference
        tracker.add(out.router_logits, inputs.get("attention_mask"))
    # The head is called as a module (not via its weight) so ZeRO-3 / FSDP gather its parameters as for any forward
    head = model.get_output_embeddings()
    hidden = out.last_hidden_state[keep]
    step = max(1, MAX_CHUNK_ELEMENTS // head.out_features)
    parts = []
    for start in range(0, max(1, hidden.shape[0]), step):
        args = (hidden[start : start + step], head, targets[start : start + step], extras)
        many = hidden.shape[0] > step and torch.is_grad_enabled()
        parts.append(checkpoint(_chunk_scores, *args, use_reentrant=False) if many else _chunk_scores(*args))
    log_probs, entropy, log_sum_sq, mean_logits, is_top1 = (None if x[0] is None else torch.cat(x) for x in zip(*parts))
    aux = None
    if moe:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        aux = load_balancing_loss_func(out.router_logits, model.config.moe_num_experts, model.config.moe_k, inputs.get("attention_mask"))
    return Scores(log_probs, entropy, log_sum_sq, mean_logits, is_top1, aux, out.router_logits if routed else None)


def _chunk_scores(hidden, head, targets, extras):
    logits = head(hidden).float()
    token, is_top1, *more = _TokenLogProb.apply(logits, targets, extras)
    entropy, log_sum_sq, mean_logits = more if extras else (None, None, None)
    return token, entropy, log_sum_sq, mean_logits, is_top1


class _TokenLogProb(torch.autograd.Function):
    """log softmax(logits)[target], with one exp over the logits and one [n, V] buffer kept for backward.

    `log_softmax` + `gather` keep the log-probabilities, build a zero [n, V] gradient for `gather` and a third
    buffer in `log_softmax`'s backward, which runs a second exp over every logit; DPO's metrics took three more
    passes with exps. Here exp(logits - max) is computed once, gives the metrics through dot products, and is
    turned into the gradient in place in backward: d log p_t / d logits = onehot(t) - softmax. These 103k-wide
    passes are most of a small ERNIE model's step outside the matmuls (benchmarks/lm_head.py measures it).
    """

    @staticmethod
    def forward(ctx, logits, targets, extras):
        top, best = logits.max(-1)
        shifted = logits - top[:, None]
        token = shifted.gather(-1, targets[:, None]).squeeze(-1)
        outputs = [best == targets]
        if extras:  # entropy, log sum of squared probabilities, mean logit (TRL's DPO metrics and WPO weights)
            exp = shifted.exp()
            total = exp.sum(-1)
            dot = lambda a, b: torch.einsum("nv,nv->n", a, b)  # noqa: E731  (a batched dot: no [n, V] temporary)
            outputs += [total.log() - dot(exp, shifted) / total, dot(exp, exp).log() - 2 * total.log(), logits.mean(-1)]
            del shifted
        else:
            exp = shifted.exp_()
            total = exp.sum(-1)
        ctx.save_for_backward(exp, total, targets)
        ctx.mark_non_differentiable(*outputs)
        return (token - total.log(), *outputs)

    @staticmethod
    def backward(ctx, grad, *_):
        exp, total, targets = ctx.saved_tensors
        # grad * (onehot - exp / total), written over the saved buffer: it is not needed again
        grad_logits = exp.mul_((-grad / total)[:, None])
        grad_logits[torch.arange(len(targets), device=targets.device), targets] += grad
        return grad_logits, None, None
