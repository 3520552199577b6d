"""Packed rows are exact: same logits and loss as each sample run alone (fp32, tiny ERNIE 4.5, real tokenizer)."""

from __future__ import annotations

import pytest
import torch

from erniekit_lite.data.collate import PackedCollator, PaddedCollator
from erniekit_lite.data.formats import Conversation, Turn
from erniekit_lite.data.packing import best_fit_decreasing, efficiency, one_per_row, pack
from erniekit_lite.data.template import template_for
from erniekit_lite.data.tokenize import IGNORE, Tokenizer
from erniekit_lite.model.load import load_model
from erniekit_lite.train import scored

CONVS = [
    Conversation([Turn("Who are you?", "I am a tiny ERNIE.")], "You are helpful."),
    Conversation([Turn("1+1?", "2"), Turn("And 2+2?", "4, of course. Anything else?")]),
    Conversation([Turn("写一首关于春天的短诗。", "春风拂面，花开满园，燕子归来。")]),
    Conversation([Turn("Say hi", "hi")]),
]


def test_best_fit_decreasing_fills_tightest_bin():
    bins = best_fit_decreasing([5, 3, 2, 4], 8)
    assert sorted(map(sorted, bins)) == [[0, 1], [2, 3]]  # 5+3 and 4+2, as in the module docstring
    lengths = [7, 1, 6, 2, 5, 3, 4, 4]
    bins = best_fit_decreasing(lengths, 8)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 8 for b in bins)
    assert len(bins) == 4  # 32 tokens in bins of 8: perfect fit exists and BFD finds it here
    with pytest.raises(ValueError):
        best_fit_decreasing([9], 8)


@pytest.fixture(scope="module")
def samples(ernie_tokenizer):
    out, _ = Tokenizer(ernie_tokenizer, template_for(ernie_tokenizer))(CONVS, max_length=512)
    return out


def _logits_alone(model, sample) -> torch.Tensor:
    ids = torch.tensor([sample.input_ids])
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0]


@pytest.mark.parametrize("attn", ["packed_sdpa", "sdpa", "eager"])
def test_packed_logits_equal_samples_alone(tiny_dense_dir, samples, attn):
    model = load_model(str(tiny_dense_dir), "float32", attn).eval()
    rows = pack(samples, 512)
    assert len(rows) == 1 and rows[0].seq_lengths == sorted((len(s) for s in samples), reverse=True)
    batch = PackedCollator(512)([vars(r) for r in rows])
    batch.pop("token_slots")
    labels = batch.pop("labels")
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]
        starts = batch["cu_seq_lens_q"].tolist()
        order = sorted(range(len(samples)), key=lambda i: -len(samples[i]))
        for k, i in enumerate(order):
            alone = _logits_alone(model, samples[i])
            diff = (packed[starts[k] : starts[k + 1]] - alone).abs().max().item()
            assert diff <= 1e-5, f"{attn}: sample {i} differs by {diff}"
    assert labels.shape == batch["input_ids"].shape


def test_packed_row_with_kv_cache_leaks_across_samples(tiny_dense_dir, samples):
    """Why every forward passes use_cache=False: with a cache transformers builds no block mask."""
    model = load_model(str(tiny_dense_dir), "float32", "sdpa").eval()
    row = pack(samples[:2], 512)[0]
    ids = torch.tensor([row.input_ids])
    pos = torch.cat([torch.arange(n) for n in row.seq_lengths])[None]
    with torch.no_grad():
        exact = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        leaky = model(input_ids=ids, position_ids=pos, use_cache=True).logits[0]
    second = slice(row.seq_lengths[0], None)
    assert (exact[second] - leaky[second]).abs().max() > 1e-3


def _row_loss(model, batch) -> tuple[torch.Tensor, int]:
    """Summed loss and trained-token count, through the trainers' scoring path."""
    scored.take(model)
    batch = dict(batch)
    batch.pop("token_slots")
    labels = batch.pop("labels")
    scores = model(**batch, score_labels=labels)
    return -scores.log_probs.sum(), scores.log_probs.numel()


def test_packed_loss_equals_token_weighted_loss_alone(tiny_dense_dir, samples):
    model = load_model(str(tiny_dense_dir), "float32", "packed_sdpa").eval()
    packed_sum, packed_n = _row_loss(model, PackedCollator(512)([vars(r) for r in pack(samples, 512)]))
    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            ids, labels = torch.tensor([s.input_ids]), torch.tensor([s.labels])
            out = model(input_ids=ids, labels=labels, use_cache=False)  # transformers' own shifted mean loss
            n = int((labels[:, 1:] != IGNORE).sum())
            total += out.loss.item() * n
            count += n
    assert packed_n == count
    assert abs(packed_sum.item() / packed_n - total / count) <= 1e-5


def test_padded_batch_loss_equals_packed(tiny_dense_dir, samples):
    model = load_model(str(tiny_dense_dir), "float32", "sdpa").eval()
    padded_sum, padded_n = _row_loss(model, PaddedCollator(0)([vars(r) for r in one_per_row(samples)]))
    model.set_attn_implementation("packed_sdpa")
    packed_sum, packed_n = _row_loss(model, PackedCollator(512)([vars(r) for r in pack(samples, 512)]))
    assert padded_n == packed_n
    assert abs(padded_sum.item() - packed_sum.item()) / packed_n <= 1e-5


@pytest.mark.parametrize("head", ["trained", "frozen"])
@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "5-position-chunks"])
def test_scored_loss_and_grads_equal_full_logits(tiny_dense_dir, samples, monkeypatch, chunked, head):
    """The trainers' loss (LM head at trained positions only, in chunks) equals cross-entropy over full logits.

    A trained head (full fine-tuning) recomputes its chunks in backward; a frozen one (LoRA: ERNIE's head is tied
    to the frozen embeddings) computes each chunk's gradient w.r.t. the hidden states in forward.
    """
    from erniekit_lite.train import scoring

    if chunked:
        monkeypatch.setattr(scoring, "MAX_CHUNK_ELEMENTS", 5 * 103424)
    model = load_model(str(tiny_dense_dir), "float32", "packed_sdpa")
    if head == "frozen":
        model.get_output_embeddings().weight.requires_grad_(False)  # tied: the input embeddings freeze too
    scored.take(model)
    batch = PackedCollator(512)([vars(r) for r in pack(samples, 512)])
    batch.pop("token_slots")
    labels = batch.pop("labels")
    scores = model(**batch, score_labels=labels)
    n = scores.log_probs.numel()
    assert n == int((labels[:, 1:] != IGNORE).sum())
    loss = -scores.log_probs.sum() / n
    loss.backward()
    fast = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    logits = model(**batch, use_cache=False).logits[0, :-1]
    ref = torch.nn.functional.cross_entropy(logits, labels[0, 1:], ignore_index=IGNORE)
    ref.backward()
    assert abs(ref.item() - loss.item()) <= 1e-5
    for k, p in model.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p.grad, fast[k], atol=1e-5, rtol=1e-4), k
    trained = labels[0, 1:] != IGNORE
    assert torch.equal(scores.is_top1, logits[trained].argmax(-1) == labels[0, 1:][trained])


def test_packing_efficiency_counts_slots(samples):
    rows = pack(samples, 512)
    assert efficiency(rows, 512) == sum(len(s) for s in samples) / 512


def test_moe_packed_logits_and_router_equal_samples_alone(tiny_moe_dir):
    """The tiny MoE (own tokenizer) packs exactly too: routing is per token, attention per sample.

    Router logits match per token, and the router aux loss of the packed row equals that of the padded batch (it is
    a batch statistic over real tokens, so padded-with-mask is the reference, not an average of samples alone).
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_moe_dir)
    moe_samples, _ = Tokenizer(tok, template_for(tok))(CONVS, max_length=512)
    model = load_model(str(tiny_moe_dir), "float32", "packed_sdpa").eval()
    batch = PackedCollator(512)([vars(r) for r in pack(moe_samples, 512)])
    batch.pop("token_slots")
    batch.pop("labels")
    order = sorted(range(len(moe_samples)), key=lambda i: -len(moe_samples[i]))
    with torch.no_grad():
        out = model(**batch, use_cache=False, output_router_logits=True)
        packed = out.logits[0]
        starts = batch["cu_seq_lens_q"].tolist()
        for k, i in enumerate(order):
            ids = torch.tensor([moe_samples[i].input_ids])
            alone = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, output_router_logits=True)
            diff = (packed[starts[k] : starts[k + 1]] - alone.logits[0]).abs().max().item()
            assert diff <= 1e-5, f"sample {i} differs by {diff}"
            for layer, (p, a) in enumerate(zip(out.router_logits, alone.router_logits)):
                diff = (p[starts[k] : starts[k + 1]] - a).abs().max().item()
                assert diff <= 1e-5, f"sample {i}, MoE layer {layer}: router logits differ by {diff}"
        padded = PaddedCollator(tok.pad_token_id)([{"input_ids": s.input_ids, "labels": s.labels} for s in moe_samples])
        padded.pop("labels")
        padded.pop("token_slots", None)
        reference = model(**padded, use_cache=False, output_router_logits=True).aux_loss
    assert len(out.router_logits) == 2  # layers 1 and 2 are MoE, layer 0 is dense
    assert out.aux_loss.item() > 0
    assert abs(out.aux_loss.item() - reference.item()) <= 1e-5


def _best_fit_decreasing_by_scan(lengths: list[int], capacity: int) -> list[list[int]]:
    """The definition, written plainly: longest first (ties in input order), each into the open bin with the least
    room that still fits it (ties: the earliest bin), else a new bin."""
    bins, rooms = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b in range(len(bins)) if rooms[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (rooms[b], b))
        else:
            b = len(bins)
            bins.append([])
            rooms.append(capacity)
        bins[b].append(i)
        rooms[b] -= lengths[i]
    return bins


@pytest.mark.parametrize("seed", range(40))
def test_best_fit_decreasing_matches_its_definition(seed):
    import random

    rng = random.Random(seed)
    capacity = rng.choice([1, 3, 8, 64, 2048])
    lengths = [rng.randint(1, capacity) for _ in range(rng.randint(0, 300))]
    assert best_fit_decreasing(lengths, capacity) == _best_fit_decreasing_by_scan(lengths, capacity)
