"""Attention run per packed sample on backends without a varlen kernel (CPU, GPUs without flash-attn).

Stock sdpa over a packed row needs a [T, T] block-diagonal mask and still computes every cross-sample score;
running sdpa once per sample with `is_causal=True` does only the useful work. The boundaries come from
`cu_seq_lens_q`, which the packed collator passes through the model's forward kwargs, as flash attention reads them.
Without them (generation, padded batches) this is plain sdpa.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "packed_sdpa"


def packed_sdpa_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    # query: [1, heads, T, dim]; key/value: [1, kv_heads, T, dim] (grouped-query attention)
    bounds = cu.tolist()
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        outputs.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, start:end],
                key[:, :, start:end],
                value[:, :, start:end],
                dropout_p=dropout if module.training else 0.0,
                is_causal=True,
                scale=scaling,
                enable_gqa=query.shape[1] != key.shape[1],
            )
        )
    out = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, packed_sdpa_forward)
