"""One packed row across N processes (`distributed.sequence_parallel: N`): Ulysses attention over heads, and the few
tensors that must be whole again after the model ran on shards.

Each process of a sequence group holds 1/N of the row's tokens (`data/sequence_shard.py` cuts them). Everything but
attention works token by token, so it runs on the shard as it is. Before attention one all-to-all gives each process
every token of 1/N of the heads; per-sample attention then runs exactly as on one process (the sample bounds are the
whole row's); after it the inverse all-to-all gives each process its own tokens back with every head. Where N does
not divide the key/value heads (ERNIE 4.5 0.3B: 2, N=4) each key/value head is repeated first, so every process
holds the key/value heads of its query heads.

What is summed or averaged over the whole row is made whole before it is used, by a sum over the group whose
backward is a sum too (`summed`): the per-token log-probabilities (`whole`: each process fills its positions, zeros
elsewhere), the MoE router logits (`whole_rows`), and a reward model's last-token hidden states (model/reward.py).
Every process of a group then computes the same loss from the same whole tensors; the backward of those sums hands
each process the gradient of its own tokens, N times over (every process's identical loss contributes), and the N
cancels where the gradients are averaged over all processes (DDP, FSDP2) and the step's counts are summed over them
(each group counts its row N times). The two collectives' backwards are the textbook ones (an all-to-all's is the
inverse all-to-all, a sum's is a sum), written here on torch.distributed's public `all_to_all_single` and
`all_reduce`: torch 2.13 deprecates `torch.distributed.nn.functional`, which had them, for a private module.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from erniekit_lite.memory import kv_repeats

KWARG = "sequence_group"  # the forward keyword the attention reads its group from (scoring.score passes it)


@dataclass(frozen=True)
class SequenceGroup:
    """The processes sharing one row: `group` a torch.distributed process group, `rank` this process's place in it,
    `size` N."""

    group: object
    rank: int
    size: int


def _to_heads(x: torch.Tensor, sg: SequenceGroup) -> torch.Tensor:
    """[1, heads, S, d] (this process's S tokens, every head) -> [1, heads/N, N*S, d] (every token, its heads)."""
    _, heads, s, d = x.shape
    sent = x[0].reshape(sg.size, heads // sg.size, s, d).contiguous()  # block j: the heads process j takes
    got = _Exchange.apply(sent, sg.group)  # block j: process j's tokens
    return got.transpose(0, 1).reshape(heads // sg.size, sg.size * s, d)[None]


def _to_tokens(out: torch.Tensor, sg: SequenceGroup) -> torch.Tensor:
    """[1, N*S, heads/N, d] (attention's output layout) -> [1, S, heads, d] (this process's tokens, every head)."""
    _, t, heads, d = out.shape
    sent = out[0].reshape(sg.size, t // sg.size, heads, d).contiguous()  # block j: process j's tokens
    got = _Exchange.apply(sent, sg.group)  # block j: process j's heads
    return got.transpose(0, 1).reshape(t // sg.size, sg.size * heads, d)[None]


def over_the_row(attention):
    """`attention` (a per-sample packed attention of model/attention.py) as registered: when the forward's keywords
    name a sequence group, run over the whole row from and to this process's shard (`across`); else as it is."""

    @functools.wraps(attention)
    def forward(module, query, key, value, attention_mask, **kwargs):
        group = kwargs.pop(KWARG, None)
        if group is None:
            return attention(module, query, key, value, attention_mask, **kwargs)
        return across(group, attention, module, query, key, value, attention_mask, **kwargs)

    return forward


def across(sg: SequenceGroup, attention, module, query, key, value, attention_mask, **kwargs):
    """`attention` (a per-sample packed attention of model/attention.py) over the whole row, from and to shards."""
    repeats = kv_repeats(query.shape[1], key.shape[1], sg.size)
    if repeats is None:
        raise ValueError(f"sequence_parallel {sg.size}: does not divide this model's {query.shape[1]} attention heads")
    if repeats > 1:
        key, value = (t.repeat_interleave(repeats, dim=1) for t in (key, value))
    query, key, value = (_to_heads(t, sg) for t in (query, key, value))
    out, weights = attention(module, query, key, value, attention_mask, **kwargs)
    return _to_tokens(out, sg), weights


def real_tokens(ids: torch.Tensor, tokens: int, sg: SequenceGroup) -> torch.Tensor:
    """[1, S]: which of this shard's tokens (`ids` [1, S]) are the row's `tokens`, not the pad sample the cut added
    (what the expert load counts)."""
    return torch.arange(ids.shape[1], device=ids.device)[None] < tokens - sg.rank * ids.shape[1]


def whole(local: torch.Tensor, slots: torch.Tensor, total: int, sg: SequenceGroup) -> torch.Tensor:
    """Per-position values of this shard (`local` [n]) at their places `slots` in the row's [total]: summed over the
    group, every process gets the whole row's, in the row's order."""
    return summed(local.new_zeros((total, *local.shape[1:])).index_put((slots,), local), sg)


def whole_rows(local: torch.Tensor, tokens: int, sg: SequenceGroup) -> torch.Tensor:
    """This shard's rows [S, ...] placed among the group's, [:tokens] of the whole [N*S, ...] (the padding cut)."""
    s = local.shape[0]
    before, after = local.new_zeros((sg.rank * s, *local.shape[1:])), local.new_zeros(((sg.size - sg.rank - 1) * s, *local.shape[1:]))
    return summed(torch.cat([before, local, after]), sg)[:tokens]


def summed(tensor: torch.Tensor, sg: SequenceGroup) -> torch.Tensor:
    """`tensor` summed over the group: each process holds its part, zeros elsewhere (with autograd: the backward sums
    the gradients; without, in place)."""
    if tensor.requires_grad:
        return _Sum.apply(tensor, sg.group)
    if tensor.dtype == torch.bool:
        return summed(tensor.to(torch.int32), sg).bool()
    dist.all_reduce(tensor, group=sg.group)
    return tensor


class _Exchange(torch.autograd.Function):
    """Block j of a contiguous [N, ...] tensor to process j, block j of the result from process j; backward: the
    same exchange of the gradients."""

    @staticmethod
    def forward(ctx, blocks, group):
        ctx.group = group
        out = torch.empty_like(blocks)
        dist.all_to_all_single(out, blocks, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _Exchange.apply(grad.contiguous(), ctx.group), None


class _Sum(torch.autograd.Function):
    """The sum over the group; backward: the sum of the gradients over the group."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _Sum.apply(grad, ctx.group), None
