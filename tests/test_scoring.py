"""The LM-head scoring path (erniekit_lite/train/scoring.py) against the plain `log_softmax` way.

Log-probs, the gradients they send to the hidden states (and to the head when it trains), top-1 hits and DPO's
metrics are compared with `log_softmax` + `gather` over full logits, with mixed-sign upstream gradients (DPO's
chosen and rejected terms), for a frozen head (gradient computed in forward) and a trained head (chunks kept or
recomputed), in one chunk and in several. Tolerance 1e-5 (fp32; the two ways sum in different orders).
"""

from __future__ import annotations

import pytest
import torch

from erniekit_lite.train import scoring
from erniekit_lite.train.scoring import head_scores

VOCAB = 1000


class CountingHead(torch.nn.Linear):
    """An LM head that counts its forward calls (a recompute would call it again in backward)."""

    calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def _case(trained: bool):
    torch.manual_seed(0)
    head = CountingHead(32, VOCAB, bias=False).requires_grad_(trained)
    hidden = (3 * torch.randn(50, 32)).requires_grad_()
    targets = torch.randint(0, VOCAB, (50,))
    weights = torch.randn(50)  # mixed-sign upstream gradients, as DPO's chosen/rejected terms give
    return head, hidden, targets, weights


def _reference(head, hidden, targets, weights):
    logits = torch.nn.functional.linear(hidden, head.weight)
    log_probs = torch.log_softmax(logits, -1)
    token = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    grads = torch.autograd.grad((token * weights).sum(), [hidden] + ([head.weight] if head.weight.requires_grad else []))
    return logits.detach(), log_probs.detach(), token.detach(), grads


@pytest.mark.parametrize("extras", [False, True], ids=["sft", "dpo-metrics"])
@pytest.mark.parametrize("chunk", [None, 7], ids=["one-chunk", "7-position-chunks"])
@pytest.mark.parametrize("mode", ["frozen", "trained-recompute", "trained-keep"])
def test_head_scores_equal_log_softmax(monkeypatch, extras, chunk, mode):
    if chunk:
        monkeypatch.setattr(scoring, "MAX_CHUNK_ELEMENTS", chunk * VOCAB)
    head, hidden, targets, weights = _case(trained=mode != "frozen")
    keep = 10**9 if mode == "trained-keep" else 0
    token, entropy, log_sum_sq, mean_logits, top1 = head_scores(head, hidden, targets, extras, keep)
    chunks = -(-50 // chunk) if chunk else 1
    assert head.calls == chunks  # the forward ran each chunk once
    got = torch.autograd.grad((token * weights).sum(), [hidden] + ([head.weight] if mode != "frozen" else []))
    recomputed = mode == "trained-recompute" and chunks > 1
    assert head.calls == chunks * (2 if recomputed else 1)  # backward recomputed them only where asked to
    logits, log_probs, ref, ref_grads = _reference(head, hidden, targets, weights)
    assert torch.allclose(token, ref, atol=1e-5)
    for g, r in zip(got, ref_grads, strict=True):
        assert torch.allclose(g, r, atol=1e-5)
    assert torch.equal(top1, logits.argmax(-1) == targets)
    if extras:
        assert torch.allclose(entropy, -(log_probs.exp() * log_probs).sum(-1), atol=1e-5)
        assert torch.allclose(log_sum_sq, torch.logsumexp(2 * log_probs, -1), atol=1e-5)
        assert torch.allclose(mean_logits, logits.mean(-1), atol=1e-5)
    else:
        assert entropy is None and log_sum_sq is None and mean_logits is None


@pytest.mark.parametrize("trained", [False, True], ids=["frozen", "trained"])
def test_without_grad_the_head_runs_once_per_chunk_and_scores_the_same(monkeypatch, trained):
    """Eval and DPO's reference pass: no gradient work, same log-probs."""
    monkeypatch.setattr(scoring, "MAX_CHUNK_ELEMENTS", 7 * VOCAB)
    head, hidden, targets, _ = _case(trained)
    with torch.no_grad():
        token, *_, top1 = head_scores(head, hidden, targets, True)
    assert head.calls == 8 and not token.requires_grad
    _, _, ref, _ = _reference(head, hidden, targets, torch.ones(50))
    assert torch.allclose(token, ref, atol=1e-5)


def test_frozen_head_backward_twice_gives_the_same_gradient():
    head, hidden, targets, weights = _case(trained=False)
    token = head_scores(head, hidden, targets, False)[0]
    loss = (token * weights).sum()
    (first,) = torch.autograd.grad(loss, hidden, retain_graph=True)
    (second,) = torch.autograd.grad(loss, hidden)
    assert torch.equal(first, second)


def test_trained_head_backward_twice_raises():
    """The trained path turns its saved buffer into the gradient in place: a second backward must not reuse it."""
    head, hidden, targets, weights = _case(trained=True)
    token = head_scores(head, hidden, targets, False)[0]
    loss = (token * weights).sum()
    torch.autograd.grad(loss, hidden, retain_graph=True)
    with pytest.raises(RuntimeError, match="back-propagated twice"):
        torch.autograd.grad(loss, hidden)


def test_frozen_head_keeps_no_logits_for_backward(monkeypatch):
    """What the frozen path keeps for backward is one gradient per position (tokens x hidden), no [n, V] buffer:
    each chunk's own head graph is gone once its gradient is taken."""
    import gc
    import weakref

    monkeypatch.setattr(scoring, "MAX_CHUNK_ELEMENTS", 7 * VOCAB)
    head, hidden, targets, _ = _case(trained=False)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), weakref.ref(t))) or t, lambda t: t):
        token = head_scores(head, hidden, targets, True)[0]
    gc.collect()
    weight = head.weight.untyped_storage().data_ptr()
    alive = [shape for shape, ref in saved if ref() is not None and ref().untyped_storage().data_ptr() != weight]
    assert alive == [(50, 32)] and token.requires_grad


@pytest.mark.parametrize("trained", [False, True], ids=["frozen", "trained"])
def test_log_probs_below_float32_underflow_stay_exact(trained):
    """A target 200 nats below the top has probability e^-200, which float32 cannot hold: its log-prob and gradient
    still equal log_softmax's (the fallback through the largest probability)."""
    head = torch.nn.Linear(4, 6, bias=False).requires_grad_(trained)
    with torch.no_grad():
        head.weight.copy_(torch.eye(6, 4))
    hidden = torch.tensor([[200.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.5, 0.0], [0.0, 0.0, 0.0, -300.0]], requires_grad=True)
    targets = torch.tensor([1, 1, 2])  # row 0: e^-200; row 1: ordinary; row 2: logit 0 against 0s and -300
    token = head_scores(head, hidden, targets, True)[0]
    ref = torch.log_softmax(torch.nn.functional.linear(hidden, head.weight), -1).gather(-1, targets[:, None]).squeeze(-1)
    assert token[0].item() == pytest.approx(-200.0, abs=1e-4) and torch.allclose(token, ref, atol=1e-5)
    (got,) = torch.autograd.grad(token.sum(), hidden)
    (want,) = torch.autograd.grad(ref.sum(), hidden)
    assert torch.allclose(got, want, atol=1e-5)


def test_a_tie_for_the_top_counts_as_a_hit():
    """is_top1 means 'no token has a larger logit than the target' (argmax would take the first of tied indices)."""
    head = torch.nn.Linear(2, 3, bias=False).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]))  # tokens 0 and 1 always tie
    hidden = torch.tensor([[2.0, 0.0], [2.0, 0.0], [0.0, 2.0]])
    top1 = head_scores(head, hidden, torch.tensor([1, 2, 0]), False)[-1]
    assert top1.tolist() == [True, False, False]


@pytest.mark.parametrize("trained", [False, True], ids=["frozen", "trained"])
def test_a_batch_without_trained_positions_scores_nothing_and_backpropagates(trained):
    head, hidden, targets, _ = _case(trained)
    token, *_, top1 = head_scores(head, hidden[:0], targets[:0], True)
    assert token.shape == (0,) and top1.shape == (0,)
    (token.sum() + (hidden * 0).sum()).backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))


@pytest.mark.parametrize("trained", [False, True], ids=["frozen", "trained"])
def test_a_head_with_a_bias_scores_and_differentiates_like_log_softmax(trained, monkeypatch):
    monkeypatch.setattr(scoring, "MAX_CHUNK_ELEMENTS", 7 * VOCAB)
    torch.manual_seed(1)
    head = torch.nn.Linear(32, VOCAB).requires_grad_(trained)
    hidden = torch.randn(30, 32, requires_grad=True)
    targets = torch.randint(0, VOCAB, (30,))
    weights = torch.randn(30)
    token = head_scores(head, hidden, targets, False, 10**9)[0]
    wrt = [hidden] + ([head.weight, head.bias] if trained else [])
    got = torch.autograd.grad((token * weights).sum(), wrt)
    ref_token = torch.log_softmax(head(hidden), -1).gather(-1, targets[:, None]).squeeze(-1)
    ref = torch.autograd.grad((ref_token * weights).sum(), wrt)
    assert torch.allclose(token, ref_token, atol=1e-5)
    for g, r in zip(got, ref, strict=True):
        assert torch.allclose(g, r, atol=1e-5)


def test_the_frozen_head_graph_stays_out_of_outer_saved_tensor_hooks():
    """An outer pair of saved-tensor hooks (TRL's activation offloading) sees nothing of the per-chunk head graph,
    which is differentiated inside the forward."""
    head, hidden, targets, weights = _case(trained=False)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(tuple(t.shape)) or t, lambda t: t):
        token = head_scores(head, hidden, targets, False)[0]
    assert packed == [(50, 32)]  # only what the real backward needs
    (got,) = torch.autograd.grad((token * weights).sum(), hidden)
    _, _, _, (ref,) = _reference(head, hidden, targets, weights)
    assert torch.allclose(got, ref, atol=1e-5)


def test_dpo_metrics_stay_fp32_under_bf16_autocast():
    """Under autocast the entropy and log-sum-sq would be computed from bf16 probabilities; they are not."""
    head, hidden, targets, _ = _case(trained=False)
    with torch.no_grad():
        head.weight.mul_(8)  # confident predictions, large logits: where bf16 rounding would show
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = head(hidden).float()  # the same bf16 logits the scoring path sees
            _, entropy, log_sum_sq, _, _ = head_scores(head, hidden, targets, True)
        log_probs = torch.log_softmax(logits, -1)
    assert torch.allclose(entropy, -(log_probs.exp() * log_probs).sum(-1), atol=1e-4)
    assert torch.allclose(log_sum_sq, torch.logsumexp(2 * log_probs, -1), atol=1e-4)
