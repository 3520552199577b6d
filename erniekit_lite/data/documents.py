"""Continued pre-training (`method: pt`): raw documents -> token pieces on disk -> packed rows, read lazily.

Documents, one per:
- record of a .jsonl / .json / .parquet file or a Hub dataset with a `text` string;
- entry of ERNIEKit's pre-training `tgt` list (`{"tgt": ["..."]}`, its `examples/data/pt-*.jsonl`);
- .txt file (the whole file is one document; `path` may be a folder, whose *.txt files are read in name order).

No chat template: a document is its text, tokenized as text (a typed `<|end_of_sentence|>` stays text), then the
end token (`</s>`, the tokenizer's eos). A document longer than `max_length` is cut into `max_length` pieces. Every
token is trained except the first of each piece: nothing in the piece comes before it to predict it, and in a
packed row the token before it belongs to another document, which must never learn to predict it.

Pieces are written as they are made to one flat int32 token file, so a corpus larger than memory streams: only
the pieces' lengths (and the packing plan over them) stay in memory; rows are read from the memory-mapped file when
the Trainer asks for them. Local inputs of 1 MiB or more keep that file in the data cache (data/cache.py: keyed by
the files' contents, the tokenizer and the settings), so a second run or `validate` skips tokenizing. In a launched
run only each machine's main process tokenizes; the others map its folder (the cache entry, or a hand-off beside the
run dir: data/handoff.py).
"""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from erniekit_lite.data import cache, handoff, mixing
from erniekit_lite.data.packing import Row, best_fit_decreasing
from erniekit_lite.data.tokenize import IGNORE, TokenStats
from erniekit_lite.errors import DataError
from erniekit_lite.files import for_user
from erniekit_lite.recipe import DataSection, Source
from erniekit_lite import words

PT_FORMATS = ("auto", "text", "erniekit", "txt")
# Documents per tokenizer call: up to this many characters (at least one document). Measured on a 32 MB corpus of
# 50-2000-word documents: 512 documents a call held 154 MiB of token lists at once and took 13 s, 16 took 4 MiB, 5 s
_BATCH_CHARS = 1 << 18
_DONE = "pieces.json"  # written last: a folder without it is an interrupted write


@dataclass
class DocumentStats(TokenStats):
    documents: int = 0
    pieces: int = 0
    cut: int = 0  # documents longer than max_length, cut into pieces
    empty: int = 0  # documents with no text, skipped


class Pieces:
    """The tokenized pieces of one split: lengths in memory, tokens in a memory-mapped int32 file."""

    def __init__(self, folder: Path, lengths: list[int]):
        import numpy as np

        self.folder, self.lengths = folder, lengths
        self.starts = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))])
        size = int(self.starts[-1])
        self.tokens = np.memmap(folder / "tokens.i32", dtype=np.int32, mode="r", shape=(size,)) if size else np.zeros(0, np.int32)

    def __len__(self) -> int:
        return len(self.lengths)

    def ids(self, i: int) -> list[int]:
        return self.tokens[self.starts[i] : self.starts[i + 1]].tolist()


class PackedPieces:
    """Rows of pieces (best-fit decreasing, as SFT packs samples), built on access from the memory-mapped tokens."""

    def __init__(self, pieces: Pieces, indices: list[int], max_length: int, packing: bool):
        self.pieces = pieces
        lengths = [pieces.lengths[i] for i in indices]
        if packing:
            self.plan = [[indices[j] for j in row] for row in best_fit_decreasing(lengths, max_length)]
        else:
            self.plan = [[i] for i in indices]
        self.real_tokens = sum(lengths)
        self.count = len(indices)  # pieces

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, r: int) -> Row:
        ids: list[int] = []
        labels: list[int] = []
        for i in self.plan[r]:
            piece = self.pieces.ids(i)
            ids += piece
            labels += [IGNORE] + piece[1:]
        return Row(ids, labels, [self.pieces.lengths[i] for i in self.plan[r]])

    def __iter__(self):
        return (self[r] for r in range(len(self)))


class RowsDataset:
    """The rows as the map-style dataset the Trainer samples from (one row read per item, nothing held)."""

    def __init__(self, rows: PackedPieces):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, r: int) -> dict:
        row = self.rows[r]
        return {"input_ids": row.input_ids, "labels": row.labels, "seq_lengths": row.seq_lengths}


@dataclass
class SourceReport:
    path: str
    format: str
    detected: bool
    documents: int = 0
    pieces: int = 0
    drawn: int | None = None  # weighted mixing: how many of its pieces the mix holds
    token_share: float | None = None  # weighted mixing: its share of the mix's tokens


@dataclass
class DocumentSplit:
    rows: PackedPieces
    pieces: Pieces
    stats: DocumentStats
    sources: list[SourceReport] = field(default_factory=list)
    max_length: int = 0

    @property
    def samples(self) -> Pieces:  # what the shared run counts as trained samples
        return self.pieces

    @property
    def packing_efficiency(self) -> float:
        return self.rows.real_tokens / max(1, len(self.rows) * self.max_length)


@dataclass
class PreparedDocuments:
    train: DocumentSplit
    eval: DocumentSplit | None
    template: str = "none (raw text)"


def prepare_documents(data: DataSection, tokenizer, seed: int = 42, log=print, beside: Path | None = None) -> PreparedDocuments:
    with handoff.session(beside) as hand:
        return _prepare_documents(data, tokenizer, seed, log, hand)


def _prepare_documents(data: DataSection, tokenizer, seed: int, log, hand: handoff.HandOff) -> PreparedDocuments:
    end = tokenizer.eos_token_id
    if end is None:
        raise DataError(", ".join(s.path for s in data.train), "method: pt needs the tokenizer's end token (eos_token), which it lacks")
    train_pieces, train_stats, reports = _tokenized(data.train, data, tokenizer, end, log, hand)
    if not len(train_pieces):
        raise DataError(", ".join(s.path for s in data.train), f"no text to train on ({train_stats.documents} documents, "
                        f"{train_stats.empty} empty)")
    indices = _mixed_indices(data.train, reports, train_pieces, seed)
    evaluation = None
    if data.eval:
        eval_pieces, eval_stats, eval_reports = _tokenized(data.eval, data, tokenizer, end, log, hand)
        evaluation = DocumentSplit(PackedPieces(eval_pieces, list(range(len(eval_pieces))), data.max_length, data.packing),
                                   eval_pieces, eval_stats, eval_reports, data.max_length)
    elif data.eval_split:
        shuffled = indices[:]
        random.Random(seed).shuffle(shuffled)
        n_eval = max(1, round(len(shuffled) * data.eval_split))
        if n_eval >= len(shuffled):
            raise DataError(data.train[0].path, f"data.eval_split={data.eval_split} leaves nothing to train on")
        held, indices = sorted(shuffled[:n_eval]), sorted(shuffled[n_eval:])
        evaluation = DocumentSplit(PackedPieces(train_pieces, held, data.max_length, data.packing), train_pieces,
                                   DocumentStats(lengths=[train_pieces.lengths[i] for i in held]), max_length=data.max_length)
    train = DocumentSplit(PackedPieces(train_pieces, indices, data.max_length, data.packing), train_pieces, train_stats,
                          reports, data.max_length)
    return PreparedDocuments(train, evaluation)


def _mixed_indices(sources: list[Source], reports: list[SourceReport], pieces: Pieces, seed: int) -> list[int]:
    """All pieces, or the weighted mix of the sources' pieces (mixing.py), with what each source gave."""
    return mixing.mix(list(range(len(pieces))), sources, [r.pieces for r in reports], reports, seed,
                      lambda i: pieces.lengths[i])


def describe_documents(data: PreparedDocuments) -> str:
    s = data.train.stats
    lines = ["data: continued pre-training (raw text, no chat template)"]
    for src in data.train.sources:
        mixed = f"; mixed in: {src.drawn} pieces, {src.token_share:.1%} of the tokens" if src.drawn is not None else ""
        lines.append(f"  {src.path} [{src.format}{' (auto)' if src.detected else ''}]: {src.documents} documents -> {src.pieces} pieces{mixed}")
    lines.append(
        f"  train: {s.documents} documents ({s.cut} cut into pieces, {s.empty} empty skipped) -> {data.train.rows.count} "
        f"pieces, {data.train.rows.real_tokens:,} tokens in {words.count(len(data.train.rows), 'row')}, packing efficiency "
        f"{data.train.packing_efficiency:.1%}"
    )
    if data.eval is not None:
        lines.append(f"  eval: {words.count(data.eval.rows.count, 'piece')} in {words.count(len(data.eval.rows), 'row')}")
    return "\n".join(lines)


# Reading -------------------------------------------------------------------------------------------------------


def _tokenized(sources: list[Source], data: DataSection, tokenizer, end: int, log,
               hand: handoff.HandOff) -> tuple[Pieces, DocumentStats, list[SourceReport]]:
    """Tokenize every source into one piece folder, or find it: in the cache, or (a launched run's other processes)
    in the folder this machine's main process handed off. Returns the pieces and statistics."""
    files = _local_files(sources) if data.cache else None
    key = None
    if files is not None and cache.local_files([str(f) for f in files]) is not None:
        settings = {"max_length": data.max_length, "end": end,
                    "sources": [{"path": s.path, "format": s.format, "max_samples": s.max_samples} for s in sources]}
        key = cache.entry_key("pt", files, cache.tokenizer_digest(tokenizer), settings)
    paths = ", ".join(s.path for s in sources)
    with hand.main_first():
        handed = hand.next()
        folder = cache.cache_dir() / f"pt-{key}" if key else None
        found = _load(folder) if folder else None
        if found is not None:
            return _reused(found, f"data cache: tokenized pieces of {paths} reused ({folder})", log)
        if handed is not None and hand.reader:
            found = _load(handed)
            if found is not None:
                return _reused(found, f"data: tokenized pieces of {paths} read from this machine's main process", log)
        if handed is not None and hand.writer and key is None:
            folder = handed  # the machine's other processes read it there; removed once they have
        return _tokenize(sources, data, tokenizer, end, log, folder, hand if folder == handed else None)


def _reused(found: tuple[Pieces, DocumentStats, list[SourceReport]], said: str, log):
    for report in found[2]:
        if report.detected:  # the line a fresh read prints
            log(f"{report.path}: pre-training format auto-detected as '{report.format}'")
    log(said)
    return found


def _tokenize(sources: list[Source], data: DataSection, tokenizer, end: int, log, folder: Path | None,
              hand: handoff.HandOff | None) -> tuple[Pieces, DocumentStats, list[SourceReport]]:
    """Pieces written to a new folder, then moved to `folder` (the cache entry or the hand-off; when None, or when
    the move fails, the folder stays private to this process and is removed at exit)."""
    from erniekit_lite.data.tokenize import Tokenizer

    encode = Tokenizer(tokenizer, None).encode
    # mkdtemp's 0700 would keep a shared cache's other users out once the folder is moved in
    work = for_user(Path(tempfile.mkdtemp(prefix=".pt-", dir=_writable(folder.parent) if folder else None)))
    lengths: list[int] = []
    stats = DocumentStats()
    reports = []
    try:
        with open(work / "tokens.i32", "wb") as out:
            for source in sources:
                fmt, detected, documents = _documents(source, log)
                report = SourceReport(source.path, fmt, detected)
                before = len(lengths)
                for batch in _batches(documents, _BATCH_CHARS):
                    report.documents += len(batch)
                    _write_pieces(encode([t for t in batch if t]), end, data.max_length, out, lengths, stats)
                    stats.empty += sum(1 for t in batch if not t)
                report.pieces = len(lengths) - before
                reports.append(report)
        stats.documents = sum(r.documents for r in reports)
        stats.lengths = lengths
        meta = {"lengths": lengths, "stats": {k: v for k, v in vars(stats).items() if k != "lengths"},
                "sources": [vars(r) for r in reports]}
        (work / _DONE).write_text(json.dumps(meta))
        try:
            if folder is None:
                raise OSError("no folder to keep it in")
            os.replace(work, folder)
            work = folder
            if hand is not None:
                hand.written(folder)
        except OSError:  # another run wrote it first, or a read-only cache: use our own copy
            atexit.register(shutil.rmtree, work, True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return Pieces(work, lengths), stats, reports


def _write_pieces(token_lists: list[list[int]], end: int, max_length: int, out, lengths: list[int], stats: DocumentStats) -> None:
    import numpy as np

    flat: list[int] = []
    for ids in token_lists:
        ids.append(end)
        stats.cut += len(ids) > max_length
        for start in range(0, len(ids), max_length):
            piece = ids[start : start + max_length]
            if len(piece) < 2:  # a lone end token: nothing in it is trained
                continue
            flat += piece
            lengths.append(len(piece))
            stats.pieces += 1
            stats.trained_tokens += len(piece) - 1
    np.asarray(flat, dtype=np.int32).tofile(out)


def _load(folder: Path) -> tuple[Pieces, DocumentStats, list[SourceReport]] | None:
    try:
        meta = json.loads((folder / _DONE).read_text())
        stats = DocumentStats(**meta["stats"], lengths=meta["lengths"])
        pieces = Pieces(folder, meta["lengths"])
        if (folder / "tokens.i32").stat().st_size != 4 * int(pieces.starts[-1]):
            raise ValueError("token file does not match its lengths")
    except Exception:  # missing, interrupted or damaged: made again
        shutil.rmtree(folder, ignore_errors=True)
        return None
    try:
        os.utime(folder)
    except OSError:
        pass
    return pieces, stats, [SourceReport(**r) for r in meta["sources"]]


def _writable(folder: Path) -> Path | None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    except OSError:
        return None


def _batches(texts: Iterator[str], chars: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _local_files(sources: list[Source]) -> list[Path] | None:
    files: list[Path] = []
    for source in sources:
        path = Path(source.path).expanduser()
        if path.is_dir():
            files += _txt_files(path)
        elif path.is_file():
            files.append(path)
        else:
            return None
    return files


def _txt_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.txt") if p.is_file())


def _documents(source: Source, log) -> tuple[str, bool, Iterator[str]]:
    """The source's format (and whether it was detected) and its documents' texts, read as they are needed."""
    from itertools import islice

    path = Path(source.path).expanduser()
    if source.format not in PT_FORMATS:
        raise DataError(source.path, f"format '{source.format}' is for chat data; method: pt reads raw text: "
                        f"{', '.join(PT_FORMATS)}")
    if path.is_dir() or path.suffix.lower() == ".txt":
        if source.format not in ("auto", "txt"):
            raise DataError(source.path, f"a .txt file or folder is read as plain text; format '{source.format}' does not apply")
        files = _txt_files(path) if path.is_dir() else [path]
        if path.is_dir() and not files:
            raise DataError(source.path, "folder holds no .txt files")
        if not path.exists():
            raise DataError(source.path, "file not found (relative paths are resolved from the working directory)")
        texts = (_read_txt(f) for f in files)
        return "txt", source.format == "auto", islice(texts, source.max_samples)
    records = _records(source)
    first = next(records, None)
    if first is None:
        raise DataError(source.path, "no records in this file")
    fmt = _detect(first) if source.format == "auto" else source.format
    if source.format == "auto":
        log(f"{source.path}: pre-training format auto-detected as '{fmt}'")

    def texts() -> Iterator[str]:
        for record in _chain(first, records):
            yield from _texts(record, fmt)

    return fmt, source.format == "auto", islice(texts(), source.max_samples)


def _chain(first, rest):
    yield first
    yield from rest


def _read_txt(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        from erniekit_lite.data.load import _not_utf8

        raise _not_utf8(path) from None


def _records(source: Source) -> Iterator:
    """Records one at a time: JSON Lines and Parquet are streamed, a .json array is read whole, a Hub dataset is
    streamed through datasets."""
    from erniekit_lite.data.load import Record, read_records

    path = Path(source.path).expanduser()
    suffix = path.suffix.lower()
    if path.is_file() and suffix == ".jsonl":
        return _jsonl(path)
    if path.is_file() and suffix == ".parquet":
        return _parquet(path)
    if path.is_file() or path.exists():
        return iter(read_records(source.path, source.split))  # .json (one array), .csv, or the reader's own error
    from erniekit_lite.data.load import _looks_like_hub_id

    if not _looks_like_hub_id(source.path):
        raise DataError(source.path, "file not found (relative paths are resolved from the working directory)")

    def hub() -> Iterator:
        import datasets

        try:
            stream = datasets.load_dataset(source.path, split=source.split, streaming=True)
            for i, row in enumerate(stream):
                yield Record(row, f"{source.path}[{source.split}]", i + 1)
        except DataError:
            raise
        except Exception as e:  # datasets raises many types; the user needs the id and the reason
            raise DataError(source.path, f"not a local file, and streaming it as a Hub dataset failed: {str(e).splitlines()[0]}") from None

    return hub()


def _jsonl(path: Path) -> Iterator:
    from erniekit_lite.data.load import Record

    with path.open(encoding="utf-8-sig") as f:
        number = 0
        while True:
            try:
                text = f.readline()
            except UnicodeDecodeError:
                from erniekit_lite.data.load import _not_utf8

                raise _not_utf8(path) from None
            if not text:
                return
            number += 1
            if not text.strip():
                continue
            try:
                yield Record(json.loads(text), str(path), number)
            except json.JSONDecodeError as e:
                raise DataError(str(path), f"malformed JSON line: {e.msg} (column {e.colno})", number) from None


def _parquet(path: Path) -> Iterator:
    import pyarrow.parquet as pq

    from erniekit_lite.data.load import Record

    try:
        table = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(str(path), f"could not read parquet file: {str(e).splitlines()[0]}") from None
    row = 0
    for batch in table.iter_batches(batch_size=1024):
        for data in batch.to_pylist():
            row += 1
            yield Record(data, str(path), row)


def _detect(record) -> str:
    data = record.data
    if isinstance(data, dict) and isinstance(data.get("text"), str):
        return "text"
    if isinstance(data, dict) and "tgt" in data:
        return "erniekit"
    keys = ", ".join(sorted(data)) if isinstance(data, dict) else type(data).__name__
    raise record.error(f"method: pt reads a 'text' string or ERNIEKit's pre-training 'tgt' list per record; found {keys}")


def _texts(record, fmt: str) -> Iterator[str]:
    data = record.fields()
    if fmt == "text":
        text = data.get("text")
        if not isinstance(text, str):
            raise record.error(f"'text' must be a string (got {type(text).__name__})" if "text" in data else "no 'text' field")
        yield text
        return
    tgt = data.get("tgt")
    if isinstance(tgt, str):
        tgt = [tgt]
    if not isinstance(tgt, list) or not all(isinstance(t, str) for t in tgt):
        raise record.error("'tgt' must be a list of strings (ERNIEKit's pre-training format: {\"tgt\": [\"text\"]})"
                           if "tgt" in data else "no 'tgt' field (ERNIEKit's pre-training format: {\"tgt\": [\"text\"]})")
    yield from tgt
