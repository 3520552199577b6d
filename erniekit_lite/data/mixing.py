"""Weighted mixing of training sources (`data.train[].weight`, ERNIEKit's `train_dataset_prob`).

The epoch keeps the sources' total count N (samples, pairs or pre-training pieces). Source i gets
n_i = N * w_i / sum(w) of them, rounded by largest remainder so the counts add up to N, so its realised share is
its weight to within 1/N. A source with fewer items than n_i is repeated whole and topped up with a seeded random
subset; one with more is subsampled (seeded, without replacement). Drawn per source in the order the source gave
them, so the same seed and data give the same mix, in any number of processes.

ERNIEKit's default `random` strategy also draws `prob x num_samples_each_epoch` per source with cycling; its epoch
size is a setting, ours is the data's own size.
"""

from __future__ import annotations

import random

from erniekit_lite.errors import DataError


def shares(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


def counts(sizes: list[int], weights: list[float]) -> list[int]:
    """How many items each source contributes: N x share, rounded by largest remainder to add up to N."""
    total = sum(sizes)
    exact = [total * p for p in shares(weights)]
    out = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: (out[i] - exact[i], i))[: total - sum(out)]:
        out[i] += 1
    return out


def draw(sizes: list[int], weights: list[float], seed: int) -> list[list[int]]:
    """For each source, the indices (into its own items, ascending within each pass) that the mix takes."""
    rng = random.Random(seed)
    picked = []
    for size, want in zip(sizes, counts(sizes, weights)):
        if size == 0:
            picked.append([])
            continue
        whole, rest = divmod(want, size)
        picked.append(list(range(size)) * whole + sorted(rng.sample(range(size), rest)))
    return picked


def mix(items: list, sources: list, sizes: list[int], reports: list, seed: int, tokens) -> list:
    """The weighted mix of the sources' items (in source order, `sizes` per source) when the sources have weights;
    each report gets `drawn` and `token_share`. `tokens(item)` counts an item's tokens."""
    if sources[0].weight is None:
        return items
    for source, size in zip(sources, sizes):
        if size == 0:
            raise DataError(source.path, f"weight {source.weight:g} is set but nothing in this source is left to train on")
    picked = draw(sizes, [s.weight for s in sources], seed)
    out, start, per_source = [], 0, []
    for size, indices in zip(sizes, picked):
        chosen = [items[start + i] for i in indices]
        per_source.append(sum(tokens(x) for x in chosen))
        out += chosen
        start += size
    for report, indices, count in zip(reports, picked, per_source):
        report.drawn, report.token_share = len(indices), count / max(1, sum(per_source))
    return out
