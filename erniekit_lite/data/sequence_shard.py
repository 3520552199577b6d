"""A packed batch cut for one process of a sequence group (`distributed.sequence_parallel: N`, model/sequence_parallel.py).

Every process of a group collates the same rows; `SequenceShard` then keeps this process's 1/N of the packed
sequence's tokens, cut on token boundaries wherever they fall (a sample may straddle two processes). The row is
first padded to a multiple of N with one more sample of pad tokens (its own causal block, never trained; the MoE's
router statistics leave it out). Kept whole: the sample bounds (`cu_seq_lens_*`, `sample_lengths`, padding
included), which attention reads once every token is back (Ulysses); the labels and the layouts TRL reads, whose
counts every process of the group takes alike. Cut: the token ids and positions, and the trained positions the LM
head runs at (`score_positions`, `score_targets`: labels were shifted before the cut, so a position whose next token
is on the next process is scored here), with `score_slots`, each one's place among the row's, and `score_total`,
so the log-probs are put back together in the row's order (`sequence_parallel.whole`). `sequence_tokens` is the row's
length before padding.

The KTO batch's KL twins (`KL_` keys) are a second packed sequence, cut the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

CUT_KEYS = ("score_slots", "score_total", "sequence_tokens")  # what the cut adds (scoring.score reads them)


@dataclass
class SequenceShard:
    collate: Callable[[list[dict]], dict]  # the method's packed collator
    size: int  # N
    rank: int  # this process's place in its group

    def __call__(self, rows: list[dict]) -> dict:
        batch = self.collate(rows)
        for prefix in ("", "KL_"):
            if f"{prefix}cu_seq_lens_q" in batch:
                cut(batch, prefix, self.size, self.rank)
        return batch


def cut(batch: dict, prefix: str, n: int, rank: int) -> None:
    """The `prefix` side of `batch`, in place: see the module doc."""
    model = f"{prefix}packed_" if f"{prefix}packed_input_ids" in batch else prefix  # pair batches: TRL's layout beside
    ids, positions = batch[f"{model}input_ids"], batch[f"{model}position_ids"]
    tokens = ids.shape[1]
    share = -(-tokens // n)
    pad = share * n - tokens
    lengths = list(batch[f"{prefix}sample_lengths"])
    if pad:
        ids = torch.cat([ids, ids.new_zeros((1, pad))], 1)
        positions = torch.cat([positions, torch.arange(pad, dtype=positions.dtype)[None]], 1)
        lengths.append(pad)
        cu = batch[f"{prefix}cu_seq_lens_q"]
        cu = torch.cat([cu, cu.new_tensor([tokens + pad])])
        longest = max(batch[f"{prefix}max_length_q"], pad)
        batch.update({f"{prefix}cu_seq_lens_q": cu, f"{prefix}cu_seq_lens_k": cu,
                      f"{prefix}max_length_q": longest, f"{prefix}max_length_k": longest})
    start = rank * share
    batch[f"{model}input_ids"], batch[f"{model}position_ids"] = ids[:, start:start + share], positions[:, start:start + share]
    batch[f"{prefix}sample_lengths"] = lengths
    scored = batch[f"{prefix}score_positions"]  # flat positions of a [1, T] row: token indices
    mine = (scored >= start) & (scored < start + share)
    batch[f"{prefix}score_slots"] = mine.nonzero().squeeze(1)
    batch[f"{prefix}score_total"] = scored.numel()
    batch[f"{prefix}score_positions"] = scored[mine] - start
    batch[f"{prefix}score_targets"] = batch[f"{prefix}score_targets"][mine]
    batch[f"{prefix}sequence_tokens"] = tokens
