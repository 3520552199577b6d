"""Per-token log-probabilities at trained positions only, with bounded LM-head memory and no recompute.

ERNIE 4.5's LM head has 103k rows, so for small models it is most of the compute, and full logits for an 8k-token
row take gigabytes. `score` (the forward's `score_labels=` path, train/scored.py) runs the backbone once, keeps the hidden states of positions
whose next token is trained, and scores them in chunks of at most `MAX_CHUNK_ELEMENTS` logits. How the gradient
gets back to the hidden states depends on whether the head trains:

- frozen head (LoRA, QLoRA: ERNIE ties the head to the frozen embeddings): while each chunk's logits exist, the
  forward also computes d log p(target) / d hidden for that chunk (tokens x hidden) and keeps only that. Backward
  scales it by the upstream gradient of each token's log-prob (SFT's -1/N, DPO's per-sequence weights). Nothing is
  recomputed and no logits outlive their chunk: the idea of Liger's fused linear cross-entropy and Apple's Cut
  Cross-Entropy, kept general (per-token log-probs, any upstream gradient) for DPO;
- trained head (full fine-tuning): each chunk keeps its softmax buffer for backward, which also yields the head's
  weight gradient. With several chunks either all buffers are kept (no recompute) or each chunk is checkpointed
  (recomputed in backward, one chunk's memory), as `keep_positions` allows; the trainer sets it from the memory
  plan (`run_plan.head_keep_positions`).

The head is always called as a module, never read through its weight, so FSDP and ZeRO-3 gather its parameters
as for any forward. SFT and DPO both read their losses and metrics from these scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from erniekit_lite.data.collate import labelled_positions
from erniekit_lite.model import sequence_parallel, vl
from erniekit_lite.memory import MAX_CHUNK_ELEMENTS  # a module global here, so tests can make chunks small


@dataclass
class Scores:
    log_probs: torch.Tensor  # [n] log-probability of each trained next token (differentiable)
    entropy: torch.Tensor | None  # [n]; this and the next two only with `extras` (DPO's metrics read them)
    log_sum_sq_probs: torch.Tensor | None  # [n], no grad
    mean_logits: torch.Tensor | None  # [n], no grad
    is_top1: torch.Tensor  # [n] bool
    aux_loss: torch.Tensor | None  # MoE router load-balancing loss, when requested
    router_logits: tuple | None = None  # MoE: [tokens, experts] per MoE layer, when requested or tracked


def score(model, labels: torch.Tensor, inputs: dict, extras: bool = True, router_logits: bool = False) -> Scores:
    """`extras` adds entropy, log-sum of squared probabilities and mean logit (DPO's metrics); `output_router_logits`
    in `inputs` the aux loss; `router_logits` the router logits alone (the router losses, train/router_losses.py)."""
    moe = bool(inputs.pop("output_router_logits", False))
    tracker = getattr(model, "expert_load", None)  # an ExpertLoad during MoE training (scored.py; evaluate's model has none)
    routed = moe or router_logits or tracker is not None
    for key in ("labels", "fused_lm_head", "use_cache", "logits_to_keep"):
        inputs.pop(key, None)
    positions, targets = inputs.pop("score_positions", None), inputs.pop("score_targets", None)
    if positions is None:  # a boolean mask: its size is read back from the device (the collators' `host_facts` avoid it)
        keep, targets = labelled_positions(labels)
    if "pixel_values" in inputs:  # ERNIE-4.5-VL: images encoded apart from the packed attention's arguments
        inputs["mm_encoder_outputs"] = vl.encode_images(model.base_model, inputs.pop("pixel_values"), inputs.pop("image_grid_thw"))
    elif vl.is_vl(model.config):  # a micro-batch without images: the vision parts take part all the same
        vl.without_images(model.base_model, inputs)
    shard = _shard(model, inputs)  # distributed.sequence_parallel: this process's tokens of the row
    out = model.base_model(**inputs, use_cache=False, **({"output_router_logits": True} if routed else {}))
    router_logits = out.router_logits if routed else None
    if tracker is not None and model.training and torch.is_grad_enabled():  # policy passes only, not the reference
        tracker.add(router_logits, inputs.get("attention_mask") if shard is None else shard.real,
                    inputs.get("moe_mm_token_type_ids"))
    hidden = out.last_hidden_state[keep] if positions is None else out.last_hidden_state.flatten(0, 1).index_select(0, positions)
    head = model.get_output_embeddings()
    scores = head_scores(head, hidden, targets, extras, getattr(model, "head_keep_positions", 0))
    if shard is not None:  # the whole row's, in its order, on every process of the group
        scores = tuple(None if x is None else sequence_parallel.whole(x, shard.slots, shard.total, shard.group) for x in scores)
        if routed:
            router_logits = tuple(sequence_parallel.whole_rows(x, shard.tokens, shard.group) for x in router_logits)
    log_probs, entropy, log_sum_sq, mean_logits, is_top1 = scores
    aux = None
    if moe:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        config = model.config.get_text_config()  # ERNIE-4.5-VL: its text model's (the vision experts route alike)
        aux = load_balancing_loss_func(router_logits, config.moe_num_experts, config.moe_k, inputs.get("attention_mask"))
    return Scores(log_probs, entropy, log_sum_sq, mean_logits, is_top1, aux, router_logits)


@dataclass
class _Shard:
    group: sequence_parallel.SequenceGroup
    slots: torch.Tensor  # this shard's scored positions' places among the row's
    total: int  # the row's scored positions
    tokens: int  # the row's tokens, before the padding the cut added
    real: torch.Tensor  # [1, S]: this shard's tokens that are the row's (not padding), for the expert load


def _shard(model, inputs: dict) -> _Shard | None:
    """The sequence-parallel keys of a cut batch (data/sequence_shard.py), taken from `inputs`; the group goes to
    the attention through the forward's keywords (model/attention.py)."""
    group = getattr(model, "sequence_group", None)
    if group is None or "score_slots" not in inputs:
        return None
    inputs[sequence_parallel.KWARG] = group
    tokens = inputs.pop("sequence_tokens")
    real = sequence_parallel.real_tokens(inputs["input_ids"], tokens, group)
    return _Shard(group, inputs.pop("score_slots"), inputs.pop("score_total"), tokens, real)


def head_trains(head) -> bool:
    """Whether the LM head has trainable parameters (full fine-tuning); LoRA leaves ERNIE's tied head frozen."""
    return any(p.requires_grad for p in head.parameters())


def head_scores(head, hidden, targets, extras: bool, keep_positions: int = 0) -> tuple:
    """(log_probs, entropy, log_sum_sq, mean_logits, is_top1) of `targets` under `head(hidden)`; see the module doc.

    `keep_positions`: with a trained head, keep every chunk's buffer (no recompute) when there are at most this many
    positions; above it, each chunk is checkpointed.
    """
    step = max(1, MAX_CHUNK_ELEMENTS // head.out_features)
    trains = head_trains(head)
    if not torch.is_grad_enabled() or not (hidden.requires_grad or trains):  # eval, reference passes
        return _head_chunks(hidden, targets, head, extras, step, want_grad=False)[0]
    if not trains:
        return _FrozenHeadLogProb.apply(hidden, targets, head, extras, step)
    n = hidden.shape[0]
    recompute = n > step and n > keep_positions
    parts = []
    for start in range(0, max(1, n), step):
        args = (hidden[start : start + step], head, targets[start : start + step], extras)
        parts.append(checkpoint(_chunk_scores, *args, use_reentrant=False) if recompute else _chunk_scores(*args))
    return tuple(None if x[0] is None else torch.cat(x) for x in zip(*parts))


def _head_chunks(hidden, targets, head, extras: bool, step: int, want_grad: bool):
    """The chunk loop of the no-grad path and of `_FrozenHeadLogProb.forward`; with `want_grad`, also each
    position's gradient of log p(target) w.r.t. its hidden state."""
    n, vocab = hidden.shape[0], head.out_features
    grad_hidden = torch.empty_like(hidden) if want_grad else None
    spare = hidden.new_empty((min(step, n), vocab), dtype=torch.float32) if extras else None  # reused by chunks
    parts = []
    for start in range(0, max(1, n), step):
        stop = min(n, start + step)
        h, t = hidden[start:stop].detach(), targets[start:stop]
        if want_grad:
            h.requires_grad_()
        # The chunk's own small graph is differentiated right here: identity saved-tensor hooks keep it away from
        # any outer ones (TRL's activation offloading, checkpointing), which belong to the model's real backward
        with torch.set_grad_enabled(want_grad), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            logits = head(h)
            token, top1, more, probs = _softmax_parts(logits.detach().float(), t, extras, spare)
            parts.append((token, *more, top1))
            if want_grad:
                # d log p_t / d logits = onehot(t) - softmax: the head's own backward maps softmax - onehot (built
                # in place) to the hidden states, and the sign is flipped on that small result
                probs[torch.arange(stop - start, device=t.device), t] -= 1
                (grad,) = torch.autograd.grad(logits, h, probs.to(logits.dtype))
                torch.neg(grad, out=grad_hidden[start:stop])
        del logits, probs
    token, entropy, log_sum_sq, mean_logits, top1 = (None if x[0] is None else torch.cat(x) for x in zip(*parts))
    return (token, entropy, log_sum_sq, mean_logits, top1), grad_hidden


def _same(x):
    return x


class _FrozenHeadLogProb(torch.autograd.Function):
    """Log-probs through a frozen head, with each position's gradient w.r.t. its hidden state computed in forward.

    Backward only scales the kept gradients, so a second backward through the same graph is as correct as the first.
    """

    @staticmethod
    def forward(ctx, hidden, targets, head, extras, step):
        outputs, grad_hidden = _head_chunks(hidden, targets, head, extras, step, want_grad=True)
        ctx.save_for_backward(grad_hidden)
        token, *rest = outputs
        ctx.mark_non_differentiable(*[x for x in rest if x is not None])
        return (token, *rest)

    @staticmethod
    def backward(ctx, grad, *_):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad.to(grad_hidden.dtype)[:, None], None, None, None, None


UNDERFLOW = 1e-30  # below this a float32 probability loses precision (normal floats end at 1.2e-38)


def _softmax_parts(logits, targets, extras: bool, spare):
    """From fp32 `logits`: log p(target), top-1 hits, the extras, and the softmax.

    The softmax is written over the logits (or into `spare`, rows reused across chunks, when the extras still need
    the logits): one row-wise kernel whose rows stay in cache, where max / subtract / exp / sum / scale were five
    passes over the whole chunk. log p(target) = log softmax[target], exact to float32 rounding while that
    probability is a normal float; below `UNDERFLOW` it is (z_t - max z) + log max softmax, since the largest
    probability, exp(max z - logsumexp), is at least 1/V. `is_top1`: the target's logit is the largest (a tie for
    the top counts as a hit, where argmax would pick the first index; the exact first-index rule would cost another
    pass). Callers pass the head's output detached: autograd needs the head's input and weight to differentiate it,
    never its output, so overwriting it is safe. Autocast is off here: it would run the extras' dot products in bf16.
    """
    with torch.autocast(logits.device.type, enabled=False):
        return _softmax_parts_fp32(logits, targets, extras, spare)


def _softmax_parts_fp32(logits, targets, extras: bool, spare):
    target_logit = logits.gather(-1, targets[:, None]).squeeze(-1)
    top_index = logits.argmax(-1, keepdim=True)  # one pass, as amax; the index finds the top probability below
    top = logits.gather(-1, top_index).squeeze(-1)
    top1 = target_logit >= top
    mean_logits = logits.mean(-1) if extras else None
    probs = torch.softmax(logits, -1, out=spare[: len(targets)] if extras else logits)
    token = probs.gather(-1, targets[:, None]).squeeze(-1).log()
    # The fallback for every position, from two gathered values per row: no pass over the chunk, and no branch on
    # whether one underflowed (reading that back stalled the GPU once per chunk)
    top_prob = probs.gather(-1, top_index).squeeze(-1)
    token = torch.where(token < math.log(UNDERFLOW), target_logit - top + top_prob.log(), token)
    more = [None, None, None]
    if extras:  # entropy = logsumexp - sum p z; log sum p^2; mean logit (batched dots: no [n, V] temporary)
        dot = lambda a, b: torch.einsum("nv,nv->n", a, b)  # noqa: E731
        more = [(target_logit - token) - dot(probs, logits), dot(probs, probs).log(), mean_logits]
    return token, top1, more, probs


def _chunk_scores(hidden, head, targets, extras):
    """A trained head's chunk: the head's output through `_TokenLogProb` (its softmax buffer kept for backward)."""
    logits = head(hidden).float()
    token, is_top1, *more = _TokenLogProb.apply(logits, targets, extras)
    entropy, log_sum_sq, mean_logits = more if extras else (None, None, None)
    return token, entropy, log_sum_sq, mean_logits, is_top1


class _TokenLogProb(torch.autograd.Function):
    """log softmax(logits)[target], with one softmax over the logits and one [n, V] buffer kept for backward.

    `log_softmax` + `gather` keep the log-probabilities, build a zero [n, V] gradient for `gather` and a third
    buffer in `log_softmax`'s backward, which runs a second exp over every logit. Here the softmax is computed once,
    over the logits themselves, and turned into the gradient in place in backward:
    d log p_t / d logits = onehot(t) - softmax. A second backward would read a consumed buffer, so it raises.
    """

    @staticmethod
    def forward(ctx, logits, targets, extras):
        spare = torch.empty_like(logits) if extras else None
        token, top1, more, probs = _softmax_parts(logits.detach(), targets, extras, spare)
        ctx.save_for_backward(probs, targets)
        ctx.consumed = False
        outputs = [top1, *(m for m in more if m is not None)]
        ctx.mark_non_differentiable(*outputs)
        return (token, *outputs)

    @staticmethod
    def backward(ctx, grad, *_):
        if ctx.consumed:
            raise RuntimeError("the LM-head loss was back-propagated twice; its saved buffer became the first gradient")
        ctx.consumed = True
        probs, targets = ctx.saved_tensors
        # grad * (onehot - softmax), written over the saved buffer
        grad_logits = probs.mul_(-grad[:, None])
        grad_logits[torch.arange(len(targets), device=targets.device), targets] += grad
        return grad_logits, None, None
