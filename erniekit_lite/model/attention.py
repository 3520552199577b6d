"""Attention run per packed sample on backends without a varlen kernel (CPU, GPUs without flash-attn).

Stock sdpa over a packed row needs a [T, T] block-diagonal mask and still computes every cross-sample score;
running sdpa once per sample with `is_causal=True` does only the useful work. The boundaries come from
`cu_seq_lens_q`, which the packed collator passes through the model's forward kwargs, as flash attention reads them.
Without them (generation, padded batches) this is plain sdpa.

The row is cut with one `split` per tensor, not a slice per sample: a slice's backward materialises a zero gradient
the size of the whole row, so n samples cost n full-row fills and adds per layer (quadratic in the row at 32k
tokens of short samples), where `split`'s backward concatenates the pieces once.
"""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "packed_sdpa"
_bounds: tuple = (None, None)  # (weakref to the last cu_seq_lens tensor, its sample lengths): read once per forward


def sample_lengths(cu: torch.Tensor) -> list[int]:
    """Sample lengths from `cu_seq_lens`, read from the tensor once per batch (on a GPU each read syncs with the host)."""
    global _bounds
    ref, lengths = _bounds
    if ref is None or ref() is not cu:
        lengths = (cu[1:] - cu[:-1]).tolist()
        _bounds = (weakref.ref(cu), lengths)
    return lengths


def packed_sdpa_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    # query: [1, heads, T, dim]; key/value: [1, kv_heads, T, dim] (grouped-query attention)
    lengths = sample_lengths(cu)
    outputs = [
        torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout if module.training else 0.0, is_causal=True, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2))
    ]
    out = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, packed_sdpa_forward)
