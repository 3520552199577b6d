"""Attention over packed rows where flash-attn is not installed: per-sample sdpa (any device) and PyTorch's own
variable-length attention (CUDA).

Stock sdpa over a packed row needs a [T, T] block-diagonal mask and still computes every cross-sample score.
`packed_sdpa` runs sdpa once per sample with `is_causal=True`, doing only the useful work; `packed_varlen` hands the
whole row to `torch.nn.attention.varlen.varlen_attn` (PyTorch's flash kernel, CUDA, bf16/fp16), which takes the
sample bounds on the device as flash-attn's varlen kernel does. Both read the bounds from `cu_seq_lens_q`, which the
packed collator passes through the model's forward kwargs. Without them (generation, padded batches) both are plain
sdpa. Under `distributed.sequence_parallel` each process holds a shard of the row's tokens, and both run over the
whole row between two all-to-alls (model/sequence_parallel.py).

The row is cut with one `split` per tensor, not a slice per sample: a slice's backward materialises a zero gradient
the size of the whole row, so n samples cost n full-row fills and adds per layer (quadratic in the row at 32k
tokens of short samples), where `split`'s backward concatenates the pieces once.
"""

from __future__ import annotations

import inspect

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from erniekit_lite.model import sequence_parallel

NAME = "packed_sdpa"
VARLEN = "packed_varlen"
PACKED = (NAME, VARLEN)  # registered without a mask function: batched generation needs plain sdpa instead
LENGTHS = "erniekit_sample_lengths"  # on a batch's cu_seq_lens tensor: its sample lengths, counted on the host


def remember_lengths(cu: torch.Tensor, lengths: list[int]) -> None:
    """Tell `sample_lengths` what `cu` holds, so it never reads the tensor: the collator computes the lengths on the
    CPU (`collate.host_facts`) and the trainer hands them over once the batch is on the GPU (reading a GPU tensor
    waits for the GPU to catch up). They travel with that tensor object (a batch's examples and KTO's KL twins have
    one each) and go with it."""
    setattr(cu, LENGTHS, lengths)


def take_batch_lengths(batch: dict) -> dict:
    """Remember the sample lengths a collator counted on the CPU (`collate.host_facts`: `sample_lengths`, and KTO's
    twins' `KL_sample_lengths`) for the batch's `cu_seq_lens_q` tensors, once they are on the device; the keys go."""
    for side in ("", "KL_"):
        lengths = batch.pop(f"{side}sample_lengths", None)
        if lengths is not None:
            remember_lengths(batch[f"{side}cu_seq_lens_q"], lengths)
    return batch


def sample_lengths(cu: torch.Tensor) -> list[int]:
    """Sample lengths from `cu_seq_lens`: as remembered for this tensor, else read from it once per batch."""
    lengths = getattr(cu, LENGTHS, None)
    if lengths is None:
        lengths = (cu[1:] - cu[:-1]).tolist()
        remember_lengths(cu, lengths)
    return lengths


def _packed(query, key, kwargs) -> bool:
    return kwargs.get("cu_seq_lens_q") is not None and query.shape[0] == 1 and query.shape[2] == key.shape[2]


@torch.compiler.disable  # a loop over data-dependent bounds: traced, it would recompile for every new set of lengths
@sequence_parallel.over_the_row  # distributed.sequence_parallel: this process may hold 1/N of the row's tokens
def packed_sdpa_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if not _packed(query, key, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    # query: [1, heads, T, dim]; key/value: [1, kv_heads, T, dim] (grouped-query attention)
    lengths = sample_lengths(kwargs["cu_seq_lens_q"])
    outputs = [
        torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout if module.training else 0.0, is_causal=True, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2))
    ]
    out = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    return out.transpose(1, 2).contiguous(), None


def varlen_kernel():
    """PyTorch's varlen attention, or None where this torch has none (it arrived in 2.9)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@sequence_parallel.over_the_row
def packed_varlen_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The packed row through `varlen_attn`: no per-sample loop, no host sync; the bounds stay on the device."""
    dtype = query.dtype
    if dtype == torch.float32 and torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)  # rotary embeddings may have upcast q and k
    if (
        not _packed(query, key, kwargs)
        or dtype not in (torch.bfloat16, torch.float16)  # a flash kernel: fp32 runs per sample instead
        or (dropout and module.training)  # the kernel has no dropout
    ):
        return packed_sdpa_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    cu = kwargs["cu_seq_lens_q"]
    longest = kwargs.get("max_length_q")
    if longest is None:
        longest = max(sample_lengths(cu))
    # [1, heads, T, dim] -> [T, heads, dim], the kernel's layout
    q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))
    out = _call_varlen(q, k, v, cu.to(torch.int32), int(longest), scaling)
    return out[None].to(query.dtype), None


_PARAMETERS: dict = {}  # varlen_attn -> its parameter names (a plain dict: a compiled layer traces through it)


def _varlen_parameters(kernel) -> frozenset:
    """The parameter names of this torch's `varlen_attn`, read once (not once per layer and step)."""
    names = _PARAMETERS.get(kernel)
    if names is None:
        names = _PARAMETERS[kernel] = frozenset(inspect.signature(kernel).parameters)
    return names


def _call_varlen(q, k, v, cu, longest, scale):
    kernel = varlen_kernel()
    params = _varlen_parameters(kernel)
    extra = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}  # newer torch: causal as a window
    if "enable_gqa" in params:  # torch 2.13 takes grouped-query heads as they are
        extra["enable_gqa"] = q.shape[1] != k.shape[1]
    elif q.shape[1] != k.shape[1]:  # torch 2.9-2.11 (2.11 seen on an H200): as many key/value heads as query heads
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    if "scale" in params:
        extra["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"{VARLEN}: this torch's varlen_attn takes no scale and the model uses {scale}; use packed_sdpa")
    return kernel(q, k, v, cu, cu, longest, longest, **extra)


AttentionInterface.register(NAME, packed_sdpa_forward)
AttentionInterface.register(VARLEN, packed_varlen_forward)


def resolve_attention(setting: str, packing: bool, split: bool = False) -> str:
    """`auto`: flash attention's varlen kernel on CUDA when installed, else PyTorch's own varlen attention there
    (packed rows); per-sample sdpa for packed rows elsewhere. `split` (distributed.sequence_parallel): one of this
    module's two, which take the all-to-alls."""
    if setting != "auto":
        return setting
    if split:
        return VARLEN if torch.cuda.is_available() and varlen_kernel() is not None else NAME
    if torch.cuda.is_available():
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            if packing and varlen_kernel() is not None:
                return VARLEN
    return NAME if packing else "sdpa"
