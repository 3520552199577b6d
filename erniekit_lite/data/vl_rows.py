"""ERNIE-4.5-VL samples and pairs (data/vl.py) as training rows: read from the recipe's data, packed, and collated
into what the model and TRL's losses read.

A row holds whole samples (SFT) or whole pairs (DPO), laid end to end with per-sample attention bounds, each sample's
3D positions restarting at 0, the routing types, and the row's images (pixel values concatenated, a grid row each).
The Trainer iterates row indices (`index_dataset`): the rows, numpy images included, stay in the collator's memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from erniekit_lite.data.tokenize import IGNORE
from erniekit_lite.data.vl import VLSample, VLTemplate, messages_of, vl_pair


@dataclass
class VLRow:
    """A packed row of VL samples (data.packing: false: one sample a row)."""

    samples: list[VLSample]

    @property
    def input_ids(self) -> list[int]:  # the packing-efficiency count reads the row's tokens
        return [t for s in self.samples for t in s.input_ids]


def prepare_vl(data, tokenizer, processor, seed: int = 42, log=print):
    """`data` (the recipe's data section) read into packed rows of VL samples: the SFT data of a VL run. A sample
    longer than data.max_length is dropped (cutting it could cut an image's tokens), counted like any other."""
    from erniekit_lite.data.packing import best_fit_decreasing
    from erniekit_lite.data.prepare import PreparedData, Split
    from erniekit_lite.data.tokenize import TokenStats

    template = VLTemplate(tokenizer, processor)

    def split(sources, pack_rows: bool = True):
        stats = TokenStats()

        def keep(sample) -> bool:
            if len(sample) > data.max_length:
                stats.dropped_overlong += 1
                return False
            stats.kept += 1
            stats.lengths.append(len(sample))
            stats.trained_tokens += sum(label != IGNORE for label in sample.labels)
            return True

        samples, reports = _read(sources, data.system, "vl messages", keep,
                                 lambda fields, base, where: template.samples(messages_of(fields, base, where), where))
        return Split(rows(samples) if pack_rows else [], samples, stats, reports, max_length=data.max_length)

    def rows(samples):
        if not data.packing:
            return [VLRow([s]) for s in samples]
        return [VLRow([samples[i] for i in b]) for b in best_fit_decreasing([len(s) for s in samples], data.max_length)]

    train, evaluation = _splits(data, seed, split, rows, lambda s: s.samples, Split, TokenStats, "samples")
    return PreparedData(train, evaluation, "ernie4.5-vl")


def index_dataset(start: int, count: int):
    """The `datasets.Dataset` the Trainer iterates (TRL takes no other kind): each item the index of a row the
    collator holds, so the images stay numpy arrays in memory rather than Arrow columns."""
    from datasets import Dataset

    return Dataset.from_dict({"row": list(range(start, start + count))})


@dataclass
class VLPackedCollator:
    """Rows of VL samples laid end to end as the text collator lays them (`collate.PackedCollator`), with the VL
    model's inputs: 3D positions [3, 1, T] restarting per sample, the routing types, and the rows' images (pixel
    values concatenated, one grid row per image)."""

    max_length: int
    rows: list[VLRow] = field(default_factory=list)  # what a dataset's `row` index names (`index_dataset`)

    def __call__(self, rows: list) -> dict:
        import torch

        from erniekit_lite.data.collate import bounds, host_facts

        rows = [self.rows[r["row"]] if isinstance(r, dict) else r for r in rows]
        samples = [s for row in rows for s in row.samples]
        _, varlen = bounds([len(s) for s in samples])
        labels = torch.tensor([t for s in samples for t in s.labels], dtype=torch.long)[None]
        batch = {
            "input_ids": torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.long)[None],
            "labels": labels,
            "position_ids": torch.from_numpy(np.concatenate([s.positions for s in samples], axis=1))[:, None],
            "moe_mm_token_type_ids": torch.tensor([t for s in samples for t in s.routing_types], dtype=torch.long)[None],
            **varlen,
            "token_slots": len(rows) * self.max_length,
            **host_facts(labels, labels.numel(), varlen["cu_seq_lens_q"]),
        }
        pixels = [p for s in samples for p in s.pixel_values]
        if pixels:
            batch["pixel_values"] = torch.from_numpy(np.concatenate(pixels))
            batch["image_grid_thw"] = torch.tensor([g for s in samples for g in s.grids], dtype=torch.long)
        return batch


@dataclass
class VLPairRow:
    """Whole pairs in a row: chosen, rejected, chosen, rejected, ..."""

    samples: list[VLSample]

    @property
    def input_ids(self) -> list[int]:
        return [t for s in self.samples for t in s.input_ids]


def prepare_vl_pairs(data, tokenizer, processor, seed: int = 42, log=print):
    """`data` read into packed rows of whole VL pairs (DPO), as `prepare_vl` reads SFT data; a pair with a sequence
    longer than data.max_length is skipped and counted."""
    from erniekit_lite.data.packing import best_fit_decreasing
    from erniekit_lite.data.pairs import PairStats
    from erniekit_lite.data.prepare import PairSplit, PreparedPairs

    template = VLTemplate(tokenizer, processor)

    def rows(pairs):
        groups = best_fit_decreasing([len(p) for p in pairs], 2 * data.max_length) if data.packing else [[i] for i in range(len(pairs))]
        return [VLPairRow([s for i in g for s in (pairs[i].chosen, pairs[i].rejected)]) for g in groups]

    def split(sources, pack_rows: bool = True):
        stats = PairStats()

        def keep(pair) -> bool:
            if max(len(pair.chosen), len(pair.rejected)) > data.max_length:
                stats.skipped["longer than max_length"] += 1
                return False
            stats.kept += 1
            stats.lengths += [len(pair.chosen), len(pair.rejected)]
            return True

        pairs, reports = _read(sources, data.system, "vl pairs", keep,
                               lambda fields, base, where: [vl_pair(template, fields, base, where)])
        return PairSplit(rows(pairs) if pack_rows else [], pairs, stats, reports, max_length=data.max_length)

    train, evaluation = _splits(data, seed, split, rows, lambda s: s.pairs, PairSplit, PairStats, "pairs")
    return PreparedPairs(train, evaluation, "ernie4.5-vl")


def _read(sources, system: str | None, kind: str, keep, make) -> tuple[list, list]:
    """The items `make(fields, images' folder, "file:line")` makes of every record of `sources` (`data.system` added
    to a record without one) that `keep` keeps, and a report per source."""
    from erniekit_lite.data.load import read_records
    from erniekit_lite.data.prepare import SourceReport

    items, reports = [], []
    for source in sources:
        records = read_records(source.path, source.split, source.max_samples)
        before = len(items)
        for record in records:
            where = f"{record.path}:{record.line}"
            items += [item for item in make(with_system(record.fields(), system), Path(record.path).parent, where) if keep(item)]
        reports.append(SourceReport(source.path, kind, False, len(records), len(items) - before))
    return items, reports


def _splits(data, seed: int, split, rows, items, split_class, stats_class, what: str):
    """The train split (read, then packed unless a share is held out) and the eval one: data.eval's sources, or
    `data.eval_split` of train's items, held out with the text data's rule (`prepare._hold_out`)."""
    from erniekit_lite.data.prepare import _hold_out

    train = split(data.train, pack_rows=not data.eval_split)
    if not items(train):
        from erniekit_lite.errors import DataError

        raise DataError(", ".join(s.path for s in data.train), f"no image-text {what} within data.max_length={data.max_length}")
    evaluation = split(data.eval) if data.eval else None
    if data.eval_split:
        held, kept = _hold_out(items(train), data.eval_split, seed, train.sources[0].path)
        evaluation = split_class(rows(held), held, stats_class(), max_length=data.max_length)
        train = split_class(rows(kept), kept, train.stats, train.sources, max_length=data.max_length)
    return train, evaluation


def with_system(fields: dict, system: str | None) -> dict:
    """The record with `data.system` as its system message when it has none."""
    messages = fields.get("messages")
    if not system or not isinstance(messages, list) or any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
        return fields
    return {**fields, "messages": [{"role": "system", "content": system}, *messages]}


@dataclass
class VLPackedPairCollator:
    """Rows of VL pairs -> what `PackedPairCollator` (data/pairs.py) gives TRL's DPO loss (the padded [2B, L] layout,
    `logp_index`) and the packed sequence the model runs on, with the VL model's inputs under `packed_*` names (TRL
    hands every batch key to the model's forward; train/pair_scoring.py takes these)."""

    max_length: int
    rows: list[VLPairRow] = field(default_factory=list)

    def __call__(self, items: list) -> dict:
        import torch

        from erniekit_lite.data.collate import bounds, host_facts

        rows = [self.rows[r["row"]] if isinstance(r, dict) else r for r in items]
        samples = [s for row in rows for s in row.samples]
        lengths = [len(s) for s in samples]
        pairs, width = len(samples) // 2, max(lengths)
        padded = torch.zeros((2 * pairs, width), dtype=torch.long)
        attention = torch.zeros_like(padded)
        completion = torch.zeros_like(padded)
        index = []
        for k, s in enumerate(samples):
            row = k // 2 + (pairs if k % 2 else 0)  # chosen first, rejected second
            labels = torch.tensor(s.labels)
            padded[row, : len(s)] = torch.tensor(s.input_ids)
            attention[row, : len(s)] = 1
            completion[row, : len(s)] = (labels != IGNORE).long()
            index.append(row * (width - 1) + (labels[1:] != IGNORE).nonzero().flatten())
        ids = torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.long)[None]
        labels = torch.tensor([t for s in samples for t in s.labels], dtype=torch.long)[None]
        _, varlen = bounds(lengths)
        batch = {
            "input_ids": padded,
            "attention_mask": attention,
            "completion_mask": completion,
            "packed_input_ids": ids,
            "packed_labels": labels,
            "packed_position_ids": torch.from_numpy(np.concatenate([s.positions for s in samples], axis=1))[:, None],
            "packed_moe_mm_token_type_ids": torch.tensor([t for s in samples for t in s.routing_types], dtype=torch.long)[None],
            **varlen,
            "logp_index": torch.cat(index),
            "token_slots": len(rows) * 2 * self.max_length,
            "row_units": [len(row.samples) // 2 for row in rows],
            "chosen_tokens": int(completion[:pairs].sum()),
            **host_facts(labels, ids.numel(), varlen["cu_seq_lens_q"]),
        }
        pixels = [p for s in samples for p in s.pixel_values]
        if pixels:
            batch["packed_pixel_values"] = torch.from_numpy(np.concatenate(pixels))
            batch["packed_image_grid_thw"] = torch.tensor([g for s in samples for g in s.grids], dtype=torch.long)
        return batch
