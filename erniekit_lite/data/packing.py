"""Best-fit-decreasing packing of samples into rows of at most `max_length` tokens.

    samples (lengths)   A=5  B=3  C=2  D=4      max_length = 8
    rows                [A B]        [D C]     (8 and 6 tokens, no padding)
    position_ids        0 1 2 3 4 0 1 2 | 0 1 2 3 0 1
    seq_lengths         [5, 3]          | [4, 2]

`position_ids` restart at 0 for each sample; the collator turns `seq_lengths` into the sequence boundaries
(`cu_seq_lens`) that per-sample attention uses, so no sample attends to another.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from erniekit_lite.data.tokenize import Sample


@dataclass
class Row:
    input_ids: list[int]
    labels: list[int]
    seq_lengths: list[int]


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of the samples in each bin; every length must be <= capacity."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (remaining capacity, bin index), kept sorted
    for i in order:
        length = lengths[i]
        if length > capacity:
            raise ValueError(f"sample {i} has {length} tokens, more than the row capacity {capacity}")
        j = bisect.bisect_left(free, (length, -1))  # the fullest bin that still fits
        if j < len(free):
            remaining, b = free.pop(j)
        else:
            remaining, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if remaining - length > 0:
            bisect.insort(free, (remaining - length, b))
    return bins


def pack(samples: list[Sample], max_length: int) -> list[Row]:
    rows = []
    for indices in best_fit_decreasing([len(s) for s in samples], max_length):
        members = [samples[i] for i in indices]
        rows.append(
            Row(
                input_ids=[t for s in members for t in s.input_ids],
                labels=[t for s in members for t in s.labels],
                seq_lengths=[len(s) for s in members],
            )
        )
    return rows


def one_per_row(samples: list[Sample]) -> list[Row]:
    """The unpacked layout: each sample is its own row (padded later by the collator)."""
    return [Row(s.input_ids, s.labels, [len(s)]) for s in samples]


def efficiency(rows: list[Row], max_length: int) -> float:
    """Share of the rows' token slots that hold real tokens."""
    return sum(len(r.input_ids) for r in rows) / max(1, len(rows) * max_length)
