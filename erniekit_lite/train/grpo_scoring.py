"""GRPO's per-token log-probs of completions from one packed forward, in TRL's padded [B, C] layout.

TRL scores a generation batch as left-padded prompts + right-padded completions, [B, P + C], with the LM head at
every completion position of every row (`_get_per_token_logps_and_entropies`). Here the real tokens of the B
sequences are packed into one row with restarting positions and per-sample attention (`cu_seq_lens_*`, no cache),
the LM head runs only at positions whose next token is a completion token (`scoring.head_scores`: chunked; a frozen
head's gradient taken in forward), and the values are scattered back to [B, C]. Worked example, B = 2, prompts
`p p` and `q`, completions `a b` and `c`:

    TRL rows     [pad p p | a b]      packed row   p p a b q c          positions  0 1 2 3 0 1
                 [pad pad q | c pad]  labels       - - a b - c          (the head reads 1, 2 and 4)

Sampling temperature T divides the logits (TRL's fused head does the same); ERNIE's head has no bias, so the hidden
states are divided instead: head(h / T) = head(h) / T.
"""

from __future__ import annotations

import torch

from erniekit_lite.data.collate import bounds, labelled_positions
from erniekit_lite.data.tokenize import IGNORE
from erniekit_lite.model.attention import remember_lengths
from erniekit_lite.train.scoring import head_scores

MARK = "grpo_completion_start"  # the keyword that routes a forward call here


def packed_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> dict:
    """The packed row of TRL's padded batch: input_ids, position_ids, cu_seq_lens, labels (completion tokens only)."""
    real = attention_mask.bool()
    lengths = real.sum(1).tolist()
    labels = input_ids.masked_fill(~real, IGNORE)
    labels[:, : input_ids.shape[1] - logits_to_keep] = IGNORE
    positions, varlen = bounds(lengths, input_ids.device)
    remember_lengths(varlen["cu_seq_lens_q"], lengths)  # per-sample attention reads them from here, never from the device
    return {"input_ids": input_ids[real][None], "position_ids": positions, "labels": labels[real][None], **varlen}


def check_head(model) -> None:
    """The packed scoring divides hidden states by the temperature (the module doc): the LM head must have no bias."""
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        raise ValueError("GRPO's packed scoring divides hidden states by the temperature, which needs an LM head without bias")


def completion_scores(model, *, labels, temperature: float = 1.0, entropy: bool = False, aux: bool = False,
                      grpo_completion_start=None, **inputs) -> dict:
    """Per-token log-probs (and entropies, MoE aux loss) at the labelled positions of a packed row, flat."""
    tracker = model.expert_load  # an ExpertLoad during MoE training (scored.py)
    routed = aux or tracker is not None
    keep, targets = labelled_positions(labels)
    out = model.base_model(**inputs, use_cache=False, **({"output_router_logits": True} if routed else {}))
    if tracker is not None and model.training and torch.is_grad_enabled():  # policy passes with grad only
        tracker.add(out.router_logits, None)
    hidden = out.last_hidden_state[keep]
    if temperature != 1.0:
        hidden = hidden / temperature
    log_probs, entropies, *_ = head_scores(model.get_output_embeddings(), hidden, targets, entropy,
                                           getattr(model, "head_keep_positions", 0))
    aux_loss = None
    if aux:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        aux_loss = load_balancing_loss_func(out.router_logits, model.config.moe_num_experts, model.config.moe_k, None)
    return {"log_probs": log_probs, "entropy": entropies, "aux_loss": aux_loss}


def to_layout(values: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """Flat per-completion-token values -> TRL's [B, C] (zeros where the completion mask is 0)."""
    mask = attention_mask[:, -logits_to_keep:].bool()
    return values.new_zeros(mask.shape).masked_scatter(mask, values)
