"""Recipe data section -> packed (or padded) training and eval rows, plus the numbers `validate` reports."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from collections import Counter

from erniekit_lite.data.formats import Skip, check_format, detect_format, detect_preference_format, to_conversation, to_preference
from erniekit_lite.data.pairs import Pair, PairRow, PairStats, pack_pairs, tokenize_pairs
from erniekit_lite.data.load import read_records
from erniekit_lite.data.packing import Row, efficiency, one_per_row, pack
from erniekit_lite.data.template import template_for
from erniekit_lite.data.tokenize import Sample, Tokenizer, TokenStats
from erniekit_lite.errors import DataError
from erniekit_lite.recipe import DataSection, Source


@dataclass
class SourceReport:
    path: str
    format: str
    detected: bool
    records: int
    samples: int = 0


@dataclass
class Split:
    rows: list[Row]
    samples: list[Sample]
    stats: TokenStats
    sources: list[SourceReport] = field(default_factory=list)

    @property
    def packing_efficiency(self) -> float:
        return efficiency(self.rows, self.max_length) if self.rows else 0.0

    max_length: int = 0


@dataclass
class PreparedData:
    train: Split
    eval: Split | None
    template: str


def prepare(data: DataSection, tokenizer, seed: int = 42, log=print) -> PreparedData:
    tokenize = Tokenizer(tokenizer, template_for(tokenizer))
    train = _split(data.train, data, tokenize, log)
    if not train.samples:
        s = train.stats
        raise DataError(
            ", ".join(src.path for src in data.train),
            f"no trainable samples left after filtering ({s.dropped_overlong} longer than data.max_length={data.max_length} "
            f"and dropped, {s.dropped_untrained} with no trained response)",
        )
    evaluation = _split(data.eval, data, tokenize, log) if data.eval else None
    if data.eval_split:
        held, kept = _hold_out(train.samples, data.eval_split, seed, train.sources[0].path)
        evaluation = Split(_rows(held, data), held, TokenStats(), max_length=data.max_length)
        train = Split(_rows(kept, data), kept, train.stats, train.sources, max_length=data.max_length)
    return PreparedData(train, evaluation, tokenize.template.name)


def _split(sources: list[Source], data: DataSection, tokenize: Tokenizer, log) -> Split:
    convs, reports = [], []
    for source in sources:
        records, fmt, detected = _read(source, detect_format, "format", log)
        for record in records:
            check_format(record, fmt)
            convs.append(to_conversation(record, fmt, data.system))
        reports.append(SourceReport(source.path, fmt, detected, len(records)))
    results, stats = tokenize(convs, data.max_length, data.overlong)
    start = 0
    for report in reports:
        report.samples = sum(r is not None for r in results[start : start + report.records])
        start += report.records
    samples = [s for s in results if s is not None]
    return Split(_rows(samples, data), samples, stats, reports, max_length=data.max_length)


def _read(source: Source, detect, what: str, log):
    """The source's records and its format: as set in the recipe, or detected from the first record."""
    records = read_records(source.path, source.split, source.max_samples)
    if not records:
        raise DataError(source.path, "no records in this file")
    if source.format != "auto":
        return records, source.format, False
    fmt = detect(records[0])
    log(f"{source.path}: {what} auto-detected as '{fmt}'")
    return records, fmt, True


def _hold_out(items: list, fraction: float, seed: int, where: str) -> tuple[list, list]:
    """A seeded random `fraction` of the items for evaluation, and the rest for training."""
    shuffled = items[:]
    random.Random(seed).shuffle(shuffled)
    n_eval = max(1, round(len(shuffled) * fraction))
    if n_eval >= len(shuffled):
        raise DataError(where, f"data.eval_split={fraction} leaves nothing to train on")
    return shuffled[:n_eval], shuffled[n_eval:]


def _rows(samples: list[Sample], data: DataSection) -> list[Row]:
    return pack(samples, data.max_length) if data.packing else one_per_row(samples)


@dataclass
class PairSplit:
    rows: list[PairRow]
    pairs: list[Pair]
    stats: PairStats
    sources: list[SourceReport] = field(default_factory=list)
    max_length: int = 0

    @property
    def packing_efficiency(self) -> float:
        return sum(len(r.input_ids) for r in self.rows) / max(1, len(self.rows) * 2 * self.max_length)


@dataclass
class PreparedPairs:
    train: PairSplit
    eval: PairSplit | None
    template: str


def prepare_pairs(data: DataSection, tokenizer, seed: int = 42, log=print) -> PreparedPairs:
    """Preference data -> pairs packed whole into rows of up to 2 x max_length tokens."""
    tokenize = Tokenizer(tokenizer, template_for(tokenizer))
    train = _pair_split(data.train, data, tokenize, log)
    if not train.pairs:
        reasons = ", ".join(f"{n} {why}" for why, n in train.stats.skipped.items()) or "none readable"
        raise DataError(", ".join(s.path for s in data.train), f"no trainable preference pairs left after filtering ({reasons})")
    evaluation = _pair_split(data.eval, data, tokenize, log) if data.eval else None
    if data.eval_split:
        held, kept = _hold_out(train.pairs, data.eval_split, seed, train.sources[0].path)
        evaluation = PairSplit(pack_pairs(held, data.max_length, data.packing), held, PairStats(), max_length=data.max_length)
        train = PairSplit(pack_pairs(kept, data.max_length, data.packing), kept, train.stats, train.sources, data.max_length)
    return PreparedPairs(train, evaluation, tokenize.template.name)


def _pair_split(sources: list[Source], data: DataSection, tokenize: Tokenizer, log) -> PairSplit:
    prefs, reports, skipped = [], [], Counter()
    for source in sources:
        records, fmt, detected = _read(source, detect_preference_format, "preference format", log)
        if fmt == "messages":
            raise DataError(source.path, "format 'messages' holds no preference pairs; use erniekit, sharegpt, trl or alpaca")
        before = len(prefs)
        for record in records:
            try:
                prefs.append(to_preference(record, fmt, data.system))
            except Skip as why:
                skipped[str(why)] += 1
        reports.append(SourceReport(source.path, fmt, detected, len(records), len(prefs) - before))
    pairs, stats = tokenize_pairs(tokenize, prefs, data.max_length)
    stats.skipped.update(skipped)
    return PairSplit(pack_pairs(pairs, data.max_length, data.packing), pairs, stats, reports, data.max_length)
