"""Recipe data section -> packed (or padded) training and eval rows, plus the numbers `validate` reports."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from erniekit_lite.data.formats import check_format, detect_format, to_conversation
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
        shuffled = train.samples[:]
        random.Random(seed).shuffle(shuffled)
        n_eval = max(1, round(len(shuffled) * data.eval_split))
        if n_eval >= len(shuffled):
            raise DataError(train.sources[0].path, f"data.eval_split={data.eval_split} leaves no training samples")
        evaluation = Split(_rows(shuffled[:n_eval], data), shuffled[:n_eval], TokenStats(), max_length=data.max_length)
        train = Split(_rows(shuffled[n_eval:], data), shuffled[n_eval:], train.stats, train.sources, max_length=data.max_length)
    return PreparedData(train, evaluation, tokenize.template.name)


def _split(sources: list[Source], data: DataSection, tokenize: Tokenizer, log) -> Split:
    convs, reports = [], []
    for source in sources:
        records = read_records(source.path, source.split, source.max_samples)
        if not records:
            raise DataError(source.path, "no records in this file")
        fmt, detected = source.format, source.format == "auto"
        if detected:
            fmt = detect_format(records[0])
            log(f"{source.path}: format auto-detected as '{fmt}'")
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


def _rows(samples: list[Sample], data: DataSection) -> list[Row]:
    return pack(samples, data.max_length) if data.packing else one_per_row(samples)
