"""Recipe data section -> packed (or padded) training and eval rows, plus the numbers `validate` reports.

Per split: read the sources, turn each record into a conversation (or preference), tokenize, pack. Tokenized
samples are kept on disk (data/cache.py) and read back when the files, tokenizer and settings are unchanged;
large inputs may be tokenized by several processes (`data.num_proc`, see `_processes`), under a progress bar.
Whichever way they were made, the samples, their order and the statistics are the same.

In a launched run of several processes only each machine's main process tokenizes (and forks workers); the others
wait for it and read what it wrote: the cache entry, or, when the cache is off or the input too small for it, a
file beside the run dir (data/handoff.py).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import random
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from erniekit_lite.data import cache, handoff, mixing
from erniekit_lite.data.formats import Skip, check_format, detect_format, detect_preference_format, to_conversation, to_preference
from erniekit_lite.data.formats import detect_feedback_format, to_feedback
from erniekit_lite.data.load import read_records
from erniekit_lite.data.packing import Row, efficiency, one_per_row, pack
from erniekit_lite.data.pairs import Pair, PairRow, PairStats, pack_pairs, tokenize_pairs
from erniekit_lite.data.unpaired import Example, FeedbackRow, FeedbackStats, pack_feedback, tokenize_feedback
from erniekit_lite.data.template import RewritesHistory, template_for
from erniekit_lite.data.tokenize import Sample, Tokenizer, TokenStats
from erniekit_lite.errors import DataError
from erniekit_lite.recipe import DataSection, Source
from erniekit_lite import words

PROGRESS_MIN = 10_000  # records; smaller inputs are done before a bar would say anything
AUTO_PER_PROCESS = 5_000  # records per process before `num_proc: null` starts another one
_CHUNK = 4_096  # records per step in-process (the progress bar moves once per step)


@dataclass
class SourceReport:
    path: str
    format: str
    detected: bool
    records: int
    samples: int = 0
    drawn: int | None = None  # weighted mixing: how many of its samples (or pairs) the mix holds
    token_share: float | None = None  # weighted mixing: its share of the mix's tokens


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


def prepare(data: DataSection, tokenizer, seed: int = 42, log=print, beside: Path | None = None) -> PreparedData:
    """`beside`: in a launched run, the run dir beside which hand-offs go (data/handoff.py)."""
    with _gc_paused(), handoff.session(beside) as hand:
        return _prepare(data, tokenizer, seed, log, hand)


def _prepare(data: DataSection, tokenizer, seed: int, log, hand: handoff.HandOff) -> PreparedData:
    tokenize = Tokenizer(tokenizer, template_for(tokenizer))
    store = _Store(data, tokenizer, tokenize.template.name, log, hand)
    train = _split(data.train, data, tokenize, store, log, pack_rows=not data.eval_split, seed=seed)  # else packed after the hold-out
    if not train.samples:
        s = train.stats
        raise DataError(
            ", ".join(src.path for src in data.train),
            f"no trainable samples left after filtering ({s.dropped_overlong} longer than data.max_length={data.max_length} "
            f"and dropped, {s.dropped_untrained} with no trained response)",
        )
    evaluation = _split(data.eval, data, tokenize, store, log) if data.eval else None
    if data.eval_split:
        held, kept = _hold_out(train.samples, data.eval_split, seed, train.sources[0].path)
        evaluation = Split(_rows(held, data), held, TokenStats(), max_length=data.max_length)
        train = Split(_rows(kept, data), kept, train.stats, train.sources, max_length=data.max_length)
    return PreparedData(train, evaluation, tokenize.template.name)


def _split(sources: list[Source], data: DataSection, tokenize: Tokenizer, store: _Store, log, pack_rows: bool = True,
           seed: int = 42) -> Split:
    settings = {"max_length": data.max_length, "overlong": data.overlong, "system": data.system}
    key = store.key("sft", sources, settings)
    with store.main_first():
        entry = store.get(key, sources, "format")
        if entry is not None:
            samples = entry.samples
            stats = TokenStats(**entry.meta["stats"], lengths=[len(s) for s in samples])
            reports = _reports(entry.meta["sources"], sources)
        else:
            samples, stats, reports = _tokenized_split(sources, data, tokenize, log)
            meta = {k: v for k, v in vars(stats).items() if k != "lengths"}  # lengths are the samples' own
            store.put(key, samples, {"stats": meta, "sources": [_report_meta(r) for r in reports]})
    samples = _mixed(samples, sources, reports, seed, len)
    return Split(_rows(samples, data) if pack_rows else [], samples, stats, reports, max_length=data.max_length)


def _mixed(items: list, sources: list[Source], reports: list[SourceReport], seed: int, tokens) -> list:
    return mixing.mix(items, sources, [r.samples for r in reports], reports, seed, tokens)


def _tokenized_split(
    sources: list[Source], data: DataSection, tokenize: Tokenizer, log
) -> tuple[list[Sample], TokenStats, list[SourceReport]]:
    convs, where, reports, counts = [], [], [], []
    for source in sources:
        records, fmt, detected = _read(source, detect_format, "format", log)
        start = len(convs)
        split = 0
        for record in records:
            check_format(record, fmt)
            parts = tokenize.template.expand(to_conversation(record, fmt, data.system))
            split += len(parts) > 1
            convs += parts
            where += [(record.path, record.line)] * len(parts)
        reports.append(SourceReport(source.path, fmt, detected, len(records)))
        counts.append(len(convs) - start)
        if split:
            log(f"data: {source.path}: the model's chat template rewrites earlier turns (e.g. drops their reasoning), so "
                f"each trained assistant turn of {split} multi-turn conversations is its own sample, with the "
                "conversation so far as its prompt")

    def job(lo: int, hi: int) -> tuple[list[Sample | None], TokenStats]:
        return tokenize(convs[lo:hi], data.max_length, data.overlong)

    results, stats = [], TokenStats()
    for part, part_stats in _in_shards(_located(job, where), len(convs), data.num_proc):
        results += part
        stats.add(part_stats)
    start = 0
    for report, count in zip(reports, counts):
        report.samples = sum(r is not None for r in results[start : start + count])
        start += count
    return [s for s in results if s is not None], stats, reports


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


def prepare_pairs(data: DataSection, tokenizer, seed: int = 42, log=print, beside: Path | None = None) -> PreparedPairs:
    """Preference data -> pairs packed whole into rows of up to 2 x max_length tokens."""
    with _gc_paused(), handoff.session(beside) as hand:
        return _prepare_pairs(data, tokenizer, seed, log, hand)


def _prepare_pairs(data: DataSection, tokenizer, seed: int, log, hand: handoff.HandOff) -> PreparedPairs:
    tokenize = Tokenizer(tokenizer, template_for(tokenizer))
    store = _Store(data, tokenizer, tokenize.template.name, log, hand)
    train = _pair_split(data.train, data, tokenize, store, log, pack_rows=not data.eval_split, seed=seed)
    if not train.pairs:
        reasons = ", ".join(f"{n} {why}" for why, n in train.stats.skipped.items()) or "none readable"
        raise DataError(", ".join(s.path for s in data.train), f"no trainable preference pairs left after filtering ({reasons})")
    evaluation = _pair_split(data.eval, data, tokenize, store, log) if data.eval else None
    if data.eval_split:
        held, kept = _hold_out(train.pairs, data.eval_split, seed, train.sources[0].path)
        evaluation = PairSplit(pack_pairs(held, data.max_length, data.packing), held, PairStats(), max_length=data.max_length)
        train = PairSplit(pack_pairs(kept, data.max_length, data.packing), kept, train.stats, train.sources, data.max_length)
    return PreparedPairs(train, evaluation, tokenize.template.name)


def _pair_split(sources: list[Source], data: DataSection, tokenize: Tokenizer, store: _Store, log, pack_rows: bool = True,
                seed: int = 42) -> PairSplit:
    key = store.key("dpo", sources, {"max_length": data.max_length, "system": data.system})
    with store.main_first():
        entry = store.get(key, sources, "preference format")
        if entry is not None:
            pairs = [Pair(c, r) for c, r in zip(entry.samples[0::2], entry.samples[1::2])]
            stats = PairStats(
                kept=entry.meta["stats"]["kept"],
                truncated=entry.meta["stats"]["truncated"],
                skipped=Counter(dict(entry.meta["stats"]["skipped"])),  # stored as pairs: the order is the message's
                lengths=[len(s) for s in entry.samples],
            )
            reports = _reports(entry.meta["sources"], sources)
        else:
            pairs, stats, reports = _tokenized_pairs(sources, data, tokenize, log)
            meta = {"kept": stats.kept, "truncated": stats.truncated, "skipped": list(stats.skipped.items())}
            samples = [s for p in pairs for s in (p.chosen, p.rejected)]
            store.put(key, samples, {"stats": meta, "sources": [_report_meta(r) for r in reports]})
    pairs = _mixed(pairs, sources, reports, seed, len)
    rows = pack_pairs(pairs, data.max_length, data.packing) if pack_rows else []
    return PairSplit(rows, pairs, stats, reports, data.max_length)


def _tokenized_pairs(
    sources: list[Source], data: DataSection, tokenize: Tokenizer, log
) -> tuple[list[Pair], PairStats, list[SourceReport]]:
    def check(source: Source, fmt: str) -> None:
        if fmt == "messages":
            raise DataError(source.path, "format 'messages' holds no preference pairs; use erniekit, sharegpt, trl or alpaca")

    return _read_and_tokenize(sources, data, tokenize, log, detect_preference_format, "preference format", to_preference,
                              tokenize_pairs, PairStats(), check)


def _read_and_tokenize(sources: list[Source], data: DataSection, tokenize: Tokenizer, log, detect, what: str, convert,
                       tokenize_all, stats, check=lambda source, fmt: None):
    """Pairs or feedback: each source's records read in its format (`detect`ed when auto) and converted, untrainable
    ones counted by reason, then tokenized in shards (`data.num_proc`); `stats` gathers the shards' counts."""
    items, where, reports, skipped = [], [], [], Counter()
    for source in sources:
        records, fmt, detected = _read(source, detect, what, log)
        check(source, fmt)
        before = len(items)
        for record in records:
            try:
                items.append(convert(record, fmt, data.system))
                where.append((record.path, record.line))
            except Skip as why:
                skipped[str(why)] += 1
        reports.append(SourceReport(source.path, fmt, detected, len(records), len(items) - before))

    def job(lo: int, hi: int):
        return tokenize_all(tokenize, items[lo:hi], data.max_length)

    tokenized = []
    for part, part_stats in _in_shards(_located(job, where), len(items), data.num_proc):
        tokenized += part
        stats.add(part_stats)
    stats.skipped.update(skipped)
    return tokenized, stats, reports


def _located(job: Callable[[int, int], tuple], where: list[tuple[str, int | None]]) -> Callable[[int, int], tuple]:
    """`job(lo, hi)`, with an error of the model's chat template (a conversation it cannot split into trained turns)
    placed at the record it came from: the range is tokenized again item by item until the item that raises."""

    def run(lo: int, hi: int) -> tuple:
        try:
            return job(lo, hi)
        except RewritesHistory:
            for i in range(lo, hi):
                try:
                    job(i, i + 1)
                except RewritesHistory as e:
                    raise DataError(where[i][0], str(e), where[i][1]) from None
            raise

    return run


def _report_meta(report: SourceReport) -> dict:
    return {"format": report.format, "detected": report.detected, "records": report.records, "samples": report.samples}


def _reports(metas: list[dict], sources: list[Source]) -> list[SourceReport]:
    """Cached source reports under the recipe's own paths (the key holds the files' contents, not their names)."""
    return [SourceReport(source.path, **meta) for source, meta in zip(sources, metas)]


class _Store:
    """The data cache as a split uses it: one key per split, and writes that never fail a run. In a launched run,
    each machine's main process makes a split first (`main_first`) and the others read what it wrote: the cache
    entry, else its hand-off file."""

    def __init__(self, data: DataSection, tokenizer, template: str, log, hand: handoff.HandOff):
        self.enabled, self.tokenizer, self.template, self.log, self.hand = data.cache, tokenizer, template, log, hand
        self._tokenizer_hash: str | None = None  # computed once, and only when some split is cacheable
        self.main_first = hand.main_first
        self._path: Path | None = None  # the current split's hand-off (`get` asks for it)

    def key(self, kind: str, sources: list[Source], settings: dict) -> str | None:
        files = cache.local_files([s.path for s in sources]) if self.enabled else None
        if files is None:
            return None
        if self._tokenizer_hash is None:
            self._tokenizer_hash = cache.tokenizer_digest(self.tokenizer)
        per_source = [{"format": s.format, "split": s.split, "max_samples": s.max_samples} for s in sources]
        return cache.entry_key(kind, files, self._tokenizer_hash, {"template": self.template, "sources": per_source, **settings})

    def get(self, key: str | None, sources: list[Source], what: str) -> cache.Entry | None:
        self._path = self.hand.next()
        entry = cache.load(key) if key else None
        paths = ", ".join(s.path for s in sources)
        said = f"data cache: tokenized samples of {paths} reused ({cache.cache_dir() / key}.npz)" if entry else None
        if entry is None and self._path is not None and self.hand.reader:
            entry = cache.load(self._path.name, self._path.parent)  # None when the main could not write it: tokenized here
            said = f"data: tokenized samples of {paths} read from this machine's main process"
        if entry is not None:
            for source, meta in zip(sources, entry.meta["sources"]):
                if meta["detected"]:  # the line a fresh read prints
                    self.log(f"{source.path}: {what} auto-detected as '{meta['format']}'")
            self.log(said)
        return entry

    def put(self, key: str | None, samples: list[Sample], meta: dict) -> None:
        if key is not None:
            try:
                cache.store(key, cache.Entry(samples, meta))
                return
            except OSError as e:  # a full disk or read-only home must not stop training
                self.log(f"data cache: not written ({e}); continuing without it")
        if self._path is None or not self.hand.writer:
            return
        folder = self._path.parent
        try:
            self.hand.written(cache.store(self._path.name, cache.Entry(samples, meta), folder, prune=False))
        except OSError as e:  # the other processes then tokenize for themselves
            self.log(f"data: {folder}: hand-off to this machine's other processes not written ({e}); each tokenizes itself")


def _processes(setting: int | None, records: int) -> int:
    """How many processes tokenize: `data.num_proc` when set; else one per 5,000 records up to one per core,
    except on 2 cores or fewer while the tokenizer runs its own threads.

    Why: the Rust tokenizer spreads each batch over every core unless TOKENIZERS_PARALLELISM turns that off, and
    it is ~80% of the work (alpaca, ERNIE 4.5 tokenizer: ~0.4 ms of CPU per record in it, ~0.1 ms in Python).
    Worker processes win back only the Python part, while each one's tokenizer drops to one thread. Measured on
    2 cores (benchmarks/preprocess.py), 100k alpaca records: 29.5 s in 1 process, 35.6 s in 2; with the
    tokenizer's threads off, 39.5 s in 1 and 32.8 s in 2. With its threads off or more cores, processes pay.
    """
    if records < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    if setting is not None:
        return min(setting, records)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores <= 2 and _tokenizer_threads():
        return 1
    return max(1, min(cores, records // AUTO_PER_PROCESS))


def _tokenizer_threads() -> bool:
    """Whether the Rust tokenizer may use its thread pool (its own reading of TOKENIZERS_PARALLELISM)."""
    return os.environ.get("TOKENIZERS_PARALLELISM", "true").lower() not in ("", "off", "false", "f", "no", "n", "0")


_FAILED = "erniekit-lite: shard failed"


def _in_shards(job: Callable[[int, int], tuple], count: int, num_proc: int | None) -> list[tuple]:
    """`job(lo, hi)` over consecutive ranges covering [0, count), results in order, under a progress bar.

    With several processes the workers are forked, so they share the parent's conversations and tokenizer
    without copying or pickling them; only the samples travel back. Why not `datasets.map(num_proc=N)`: its
    input is an Arrow table, so the conversations (nested dicts of varying shape, tool schemas) would first have
    to be serialized into one, and every sample is written to Arrow files and read back. Measured on 20k alpaca
    records, 2 processes, even with its function reading the conversations through fork as here: 7.6-9.1 s and
    ~14.5 CPU-s for `datasets.map`, 6.3-6.6 s and ~12.5 CPU-s for this pool. A worker that fails has its range
    run again here, so the error (and its traceback) is exactly what a run in one process gives.
    """
    processes = _processes(num_proc, count)
    size = _CHUNK if processes == 1 else max(1, min(_CHUNK, -(-count // (processes * 8))))
    ranges = [(lo, min(count, lo + size)) for lo in range(0, count, size)]
    results = []
    with _progress(count) as bar:
        if processes == 1:
            for lo, hi in ranges:
                results.append(job(lo, hi))
                bar.update(hi - lo)
            return results
        with _fork_pool(processes, job) as pool:
            for (lo, hi), result in zip(ranges, pool.imap(_run_job, ranges)):
                results.append(job(lo, hi) if isinstance(result, str) and result == _FAILED else result)
                bar.update(hi - lo)
    return results


def _take_job(job: Callable) -> None:
    """A forked worker's start: its task, handed over through fork (never pickled), kept in the worker only."""
    _run_job.job = job


def _run_job(bounds: tuple[int, int]):
    try:
        return _run_job.job(*bounds)
    except Exception:  # reported by running the range again in the parent (an exception may not pickle)
        return _FAILED


@contextmanager
def _fork_pool(processes: int, job: Callable):
    # One tokenizer thread per worker: set before forking so the workers inherit it (and tokenizers does not
    # warn about forking after its thread pool started); the parent's own setting is put back right after
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        # fork: the initializer's argument reaches each worker by inheritance, not pickling
        pool = multiprocessing.get_context("fork").Pool(processes, initializer=_take_job, initargs=(job,))
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before
    with pool:
        yield pool


@contextmanager
def _gc_paused():
    """Python's cycle collector off while samples are made: every full collection walks each token of every list
    made so far, which took over half the time of packing or loading 100k cached samples. Nothing here makes
    reference cycles; whatever garbage there is waits until the end."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _progress(records: int):
    from tqdm.auto import tqdm

    # disable=None: shown only on a terminal, so logs and captured output stay clean
    return tqdm(total=records, desc="tokenizing", unit=" records", disable=True if records < PROGRESS_MIN else None, leave=False)


def describe_data(data: PreparedData) -> str:
    s = data.train.stats
    lines = [f"data: template {data.template}"]
    for src in data.train.sources:
        lines.append(f"  {src.path} [{src.format}{' (auto)' if src.detected else ''}]: {src.records} records -> {src.samples} samples"
                     + _mix_note(src, "samples"))
    lines.append(
        f"  train: {words.count(len(data.train.samples), 'sample')} in {words.count(len(data.train.rows), 'row')}, "
        f"packing efficiency {data.train.packing_efficiency:.1%}; truncated {s.truncated}, "
        f"dropped {s.dropped_overlong} overlong and {s.dropped_untrained} without trained tokens"
    )
    if data.eval is not None:
        lines.append(f"  eval: {words.count(len(data.eval.samples), 'sample')} in {words.count(len(data.eval.rows), 'row')}")
    return "\n".join(lines)


def describe_pairs(data: PreparedPairs) -> str:
    s = data.train.stats
    lines = [f"data: template {data.template}, preference pairs"]
    for src in data.train.sources:
        lines.append(f"  {src.path} [{src.format}{' (auto)' if src.detected else ''}]: {src.records} records -> {src.samples} pairs"
                     + _mix_note(src, "pairs"))
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(s.skipped.items())) or "none"
    lines.append(
        f"  train: {words.count(len(data.train.pairs), 'pair')} in {words.count(len(data.train.rows), 'row')}, packing efficiency "
        f"{data.train.packing_efficiency:.1%}; truncated {s.truncated}; skipped: {skipped}"
    )
    if data.eval is not None:
        lines.append(f"  eval: {words.count(len(data.eval.pairs), 'pair')} in {words.count(len(data.eval.rows), 'row')}")
    return "\n".join(lines)



@dataclass
class FeedbackSplit:
    rows: list[FeedbackRow]
    examples: list[Example]
    stats: FeedbackStats
    sources: list[SourceReport] = field(default_factory=list)
    max_length: int = 0
    kl: bool = True  # rows hold each example's KL twin

    @property
    def packing_efficiency(self) -> float:
        capacity = (2 if self.kl else 1) * self.max_length
        return sum(len(r.input_ids) for r in self.rows) / max(1, len(self.rows) * capacity)


@dataclass
class PreparedFeedback:
    train: FeedbackSplit
    eval: FeedbackSplit | None
    template: str


def prepare_feedback(data: DataSection, tokenizer, seed: int = 42, log=print, kl: bool = True,
                     beside: Path | None = None) -> PreparedFeedback:
    """Unpaired feedback (KTO) -> examples packed whole into rows, each with its KL twin when `kl` (data/unpaired.py)."""
    with _gc_paused(), handoff.session(beside) as hand:
        return _prepare_feedback(data, tokenizer, seed, log, kl, hand)


def _prepare_feedback(data: DataSection, tokenizer, seed: int, log, kl: bool, hand: handoff.HandOff) -> PreparedFeedback:
    tokenize = Tokenizer(tokenizer, template_for(tokenizer))
    store = _Store(data, tokenizer, tokenize.template.name, log, hand)
    train = _feedback_split(data.train, data, tokenize, store, log, kl, pack_rows=not data.eval_split, seed=seed)
    where = ", ".join(s.path for s in data.train)
    if not train.examples:
        reasons = ", ".join(f"{n} {why}" for why, n in train.stats.skipped.items()) or "none readable"
        raise DataError(where, f"no trainable examples left after filtering ({reasons})")
    evaluation = _feedback_split(data.eval, data, tokenize, store, log, kl) if data.eval else None
    if data.eval_split:
        held, kept = _hold_out(train.examples, data.eval_split, seed, train.sources[0].path)
        evaluation = FeedbackSplit(pack_feedback(held, data.max_length, data.packing, kl), held, FeedbackStats(),
                                   max_length=data.max_length, kl=kl)
        train = FeedbackSplit(pack_feedback(kept, data.max_length, data.packing, kl), kept, train.stats, train.sources,
                              data.max_length, kl)
    if kl and len(train.examples) < 2:
        raise DataError(where, "KTO estimates its KL term from each prompt paired with another example's completion: "
                               "at least 2 training examples are needed (or train.loss_type: apo_zero_unpaired, which has none)")
    return PreparedFeedback(train, evaluation, tokenize.template.name)


def _feedback_split(sources: list[Source], data: DataSection, tokenize: Tokenizer, store: _Store, log, kl: bool,
                    pack_rows: bool = True, seed: int = 42) -> FeedbackSplit:
    key = store.key("kto", sources, {"max_length": data.max_length, "system": data.system})
    with store.main_first():
        entry = store.get(key, sources, "feedback format")
        if entry is not None:
            labels = entry.meta["desirable"]  # one character per example: "1" desirable, "0" not
            examples = [Example(s, flag == "1") for s, flag in zip(entry.samples, labels)]
            stats = FeedbackStats(kept=len(examples), truncated=entry.meta["stats"]["truncated"],
                                  skipped=Counter(dict(entry.meta["stats"]["skipped"])),  # stored as pairs: the message's order
                                  lengths=[len(e) for e in examples], desirable=labels.count("1"))
            reports = _reports(entry.meta["sources"], sources)
        else:
            examples, stats, reports = _tokenized_feedback(sources, data, tokenize, log)
            meta = {"truncated": stats.truncated, "skipped": list(stats.skipped.items())}
            store.put(key, [e.sample for e in examples], {"stats": meta, "sources": [_report_meta(r) for r in reports],
                                                          "desirable": "".join("1" if e.desirable else "0" for e in examples)})
    examples = _mixed(examples, sources, reports, seed, len)
    rows = pack_feedback(examples, data.max_length, data.packing, kl) if pack_rows else []
    return FeedbackSplit(rows, examples, stats, reports, data.max_length, kl)


def _tokenized_feedback(
    sources: list[Source], data: DataSection, tokenize: Tokenizer, log
) -> tuple[list[Example], FeedbackStats, list[SourceReport]]:
    return _read_and_tokenize(sources, data, tokenize, log, detect_feedback_format, "feedback format", to_feedback,
                              tokenize_feedback, FeedbackStats())


def describe_feedback(data: PreparedFeedback) -> str:
    s = data.train.stats
    lines = [f"data: template {data.template}, unpaired feedback (KTO)"]
    for src in data.train.sources:
        lines.append(f"  {src.path} [{src.format}{' (auto)' if src.detected else ''}]: {src.records} records -> "
                     f"{src.samples} examples" + _mix_note(src, "examples"))
    desirable = sum(e.desirable for e in data.train.examples)
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(s.skipped.items())) or "none"
    twins = ", each with its KL twin" if data.train.kl else ""
    lines.append(
        f"  train: {words.count(len(data.train.examples), 'example')} ({desirable} desirable, "
        f"{len(data.train.examples) - desirable} undesirable) in {words.count(len(data.train.rows), 'row')}{twins}, packing efficiency {data.train.packing_efficiency:.1%}; "
        f"truncated {s.truncated}; skipped: {skipped}"
    )
    if data.eval is not None:
        held = sum(e.desirable for e in data.eval.examples)
        lines.append(f"  eval: {words.count(len(data.eval.examples), 'example')} ({held} desirable, "
                     f"{len(data.eval.examples) - held} undesirable) in {words.count(len(data.eval.rows), 'row')}")
    return "\n".join(lines)


def _mix_note(src, unit: str) -> str:
    if src.drawn is None:
        return ""
    return f"; mixed in: {src.drawn} {unit}, {src.token_share:.1%} of the tokens"
