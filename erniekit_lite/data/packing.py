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
import heapq
from dataclasses import dataclass

from erniekit_lite.data.tokenize import IGNORE, Sample


@dataclass
class Row:
    input_ids: list[int]
    labels: list[int]
    seq_lengths: list[int]


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of the samples in each bin; every length must be <= capacity.

    Longest first (ties in input order), each into the open bin with the least room that still fits it (ties: the
    earliest bin). Open bins are kept by remaining room, so finding one costs a bisect over at most `capacity`
    distinct values rather than over every open bin (100k samples: 0.2 s instead of 1.5 s).
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)  # stable: ties keep input order
    bins: list[list[int]] = []
    rooms: list[int] = []  # distinct remaining capacities that some open bin has, sorted
    open_bins: dict[int, list[int]] = {}  # remaining capacity -> heap of bin indices
    for i in order:
        length = lengths[i]
        if length > capacity:
            raise ValueError(f"sample {i} has {length} tokens, more than the row capacity {capacity}")
        j = bisect.bisect_left(rooms, length)  # the least room that still fits
        if j < len(rooms):
            room = rooms[j]
            same = open_bins[room]
            b = heapq.heappop(same)
            if not same:
                del open_bins[room]
                rooms.pop(j)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        left = room - length
        if left > 0:
            if left in open_bins:
                heapq.heappush(open_bins[left], b)
            else:
                open_bins[left] = [b]
                bisect.insort(rooms, left)
    return bins


def check_first_untrained(samples: list[Sample], what: str = "sample") -> None:
    """No sample's first token may be a target: nothing before it in the sample predicts it, and in a packed row
    the position before it belongs to another sample, which must never be trained to predict it."""
    for i, sample in enumerate(samples):
        if sample.labels and sample.labels[0] != IGNORE:
            raise ValueError(f"{what} {i}: its first token is labelled {sample.labels[0]}; the first label of a sample "
                             f"must be {IGNORE} (nothing before it in the sample predicts it)")


def pack(samples: list[Sample], max_length: int) -> list[Row]:
    check_first_untrained(samples)
    rows = []
    for indices in best_fit_decreasing([len(s) for s in samples], max_length):
        ids: list[int] = []
        labels: list[int] = []
        for i in indices:  # extending in place: a third of the time of nested comprehensions
            ids += samples[i].input_ids
            labels += samples[i].labels
        rows.append(Row(ids, labels, [len(samples[i]) for i in indices]))
    return rows


def one_per_row(samples: list[Sample]) -> list[Row]:
    """The unpacked layout: each sample is its own row (padded later by the collator)."""
    check_first_untrained(samples)
    return [Row(s.input_ids, s.labels, [len(s)]) for s in samples]


def efficiency(rows: list[Row], max_length: int) -> float:
    """Share of the rows' token slots that hold real tokens."""
    return sum(len(r.input_ids) for r in rows) / max(1, len(rows) * max_length)
