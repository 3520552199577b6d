"""The packed attentions' plumbing: `packed_varlen` (PyTorch's varlen kernel, CUDA only) driven through a CPU stand-in
of the kernel, `auto`'s choice per device, and sample bounds that the trainer hands over without reading the device.

The stand-in computes what the kernel promises (causal attention per sample over the [T, heads, dim] layout, from
the `cu_seq` bounds) with sdpa, so these tests check everything around the kernel: the layout, the bounds, causality,
grouped-query heads, the scale, each of torch's three signatures, and when the per-sample path is used instead. The kernel
itself is checked against per-sample attention on a GPU by `benchmarks/gpu_check.py`.
"""

from __future__ import annotations

import pytest
import torch

import erniekit_lite.model.attention as attention
from erniekit_lite.data.collate import PackedCollator
from erniekit_lite.data.formats import Conversation, Turn
from erniekit_lite.data.packing import pack
from erniekit_lite.data.template import template_for
from erniekit_lite.data.tokenize import Tokenizer
from erniekit_lite.model.attention import resolve_attention
from erniekit_lite.model.load import load_model

CONVS = [Conversation([Turn(f"Question {i}: " + "word " * (3 * i), "Answer " * (i + 2))]) for i in range(5)]


def _reference(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    assert q.dim() == 3 and cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k
    bounds = cu_q.tolist()
    assert max_q == max(b - a for a, b in zip(bounds, bounds[1:]))
    out = [
        torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        ).transpose(0, 1)
        for a, b in zip(bounds, bounds[1:])
    ]
    return torch.cat(out)


def new_kernel(calls):
    """torch 2.13's signature: causal as a window, grouped-query heads taken as they are."""

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False):
        assert window_size == (-1, 0) and enable_gqa == (q.shape[1] != k.shape[1])
        calls.append(q.dtype)
        return _reference(q, k, v, cu_q, cu_k, max_q, max_k, scale)

    return varlen_attn


def window_kernel(calls):
    """torch 2.11's signature (its TypeError on an H200 named enable_gqa, after scale and window_size): causal as a
    window, as many key/value heads as query heads."""

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        assert window_size == (-1, 0) and q.shape[1] == k.shape[1] == v.shape[1]
        calls.append(q.dtype)
        return _reference(q, k, v, cu_q, cu_k, max_q, max_k, scale)

    return varlen_attn


def old_kernel(calls):
    """torch 2.9's signature: is_causal, no scale, as many key/value heads as query heads."""

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
        assert is_causal and q.shape[1] == k.shape[1] == v.shape[1]
        calls.append(q.dtype)
        return _reference(q, k, v, cu_q, cu_k, max_q, max_k, None)

    return varlen_attn


@pytest.fixture(scope="module")
def batch(ernie_tokenizer):
    samples, _ = Tokenizer(ernie_tokenizer, template_for(ernie_tokenizer))(CONVS, max_length=512)
    rows = pack(samples, 512)
    assert len(rows) == 1 and len(rows[0].seq_lengths) == len(CONVS)
    out = PackedCollator(512)([vars(r) for r in rows])
    return {k: v for k, v in out.items() if k not in ("labels", "token_slots")}


def _logits(model, batch, autocast: bool) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return model(**batch, use_cache=False).logits[0].float()


@pytest.mark.parametrize("kernel", [new_kernel, window_kernel, old_kernel])
@pytest.mark.parametrize("setup", ["bf16 weights", "bf16 autocast"])
def test_packed_varlen_gives_the_per_sample_logits(tiny_dense_dir, batch, monkeypatch, kernel, setup):
    config = load_model(str(tiny_dense_dir)).config
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query heads are exercised
    calls: list = []
    monkeypatch.setattr(attention, "varlen_kernel", lambda: kernel(calls))
    dtype = "bfloat16" if setup == "bf16 weights" else "float32"
    autocast = setup == "bf16 autocast"
    varlen = _logits(load_model(str(tiny_dense_dir), dtype, "packed_varlen").eval(), batch, autocast)
    per_sample = _logits(load_model(str(tiny_dense_dir), dtype, "packed_sdpa").eval(), batch, autocast)
    assert calls == [torch.bfloat16] * config.num_hidden_layers  # one kernel call per layer, in bf16
    # The same arithmetic in another memory layout: equal up to bf16 rounding (measured 0.0078 here, one bf16 step)
    assert (varlen - per_sample).abs().max().item() <= 3e-2


def test_packed_varlen_in_fp32_runs_per_sample(tiny_dense_dir, batch, monkeypatch):
    """The kernel is a flash kernel (bf16/fp16 only): an fp32 run takes the per-sample path, bit for bit."""
    calls: list = []
    monkeypatch.setattr(attention, "varlen_kernel", lambda: new_kernel(calls))
    varlen = _logits(load_model(str(tiny_dense_dir), "float32", "packed_varlen").eval(), batch, False)
    per_sample = _logits(load_model(str(tiny_dense_dir), "float32", "packed_sdpa").eval(), batch, False)
    assert calls == [] and torch.equal(varlen, per_sample)


def test_auto_picks_the_packed_attention_each_device_can_run(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed (as on the GPU machine)
    assert resolve_attention("auto", packing=True) == "packed_sdpa"  # this CPU
    assert resolve_attention("auto", packing=False) == "sdpa"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_attention("auto", packing=True) == "packed_varlen"
    assert resolve_attention("auto", packing=False) == "sdpa"
    monkeypatch.setattr(attention, "varlen_kernel", lambda: None)  # a torch before 2.9
    assert resolve_attention("auto", packing=True) == "packed_sdpa"
    assert resolve_attention("eager", packing=True) == "eager"  # a recipe's own choice always wins


def test_the_collators_sample_lengths_are_handed_to_the_moved_batch():
    """The lengths come from the collator's CPU tensor (`collate.host_facts`); the moved tensor is never read (its
    values here are wrong on purpose: only a read of it would give them)."""
    from erniekit_lite.data.collate import PackedCollator, PaddedCollator

    rows = [{"input_ids": [1] * 7, "labels": [-100, 3, 3, 3, 3, -100, 4], "seq_lengths": [5, 2]},
            {"input_ids": [2] * 5, "labels": [-100] * 4 + [5], "seq_lengths": [5]}]
    batch = PackedCollator(8)(rows)
    assert batch["sample_lengths"] == [5, 2, 5] and batch["real_tokens"] == 12
    assert batch["score_positions"].tolist() == [0, 1, 2, 3, 5, 10] and batch["score_targets"].tolist() == [3, 3, 3, 3, 4, 5]
    moved = attention.take_batch_lengths({k: torch.zeros_like(v) if k == "cu_seq_lens_q" else v for k, v in batch.items()})
    assert "sample_lengths" not in moved
    assert attention.sample_lengths(moved["cu_seq_lens_q"]) == [5, 2, 5]
    padded = PaddedCollator(0)(rows)  # no bounds: nothing to hand over
    assert "sample_lengths" not in padded and padded["real_tokens"] == 12
    assert attention.sample_lengths(torch.tensor([0, 3, 4])) == [3, 1]  # a tensor not handed over is read
