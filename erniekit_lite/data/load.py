"""Read records from local files or the Hub, each with where it came from (file:line) for error messages."""

from __future__ import annotations

import codecs
import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from erniekit_lite import retry
from erniekit_lite.errors import DataError


@dataclass
class Record:
    data: Any
    path: str
    line: int  # 1-based line in the file (JSON/JSONL/CSV) or row number (Parquet, Hub)

    def error(self, message: str) -> DataError:
        return DataError(self.path, message, self.line)

    def fields(self) -> dict:
        """The record's JSON object; every format reads one (a list or a string in a JSONL line is an error)."""
        if not isinstance(self.data, dict):
            raise self.error(f"expected a JSON object per record, got {type(self.data).__name__}")
        return self.data


def read_records(path: str, split: str = "train", max_samples: int | None = None) -> list[Record]:
    """All records of one source. Local files by extension; anything else is tried as a Hub dataset id."""
    local = Path(path).expanduser()
    if local.is_file():
        suffix = local.suffix.lower()
        text_readers = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv}
        if suffix in text_readers:
            try:
                records = text_readers[suffix](local)
            except UnicodeDecodeError:  # found by fuzzing: a GBK or Latin-1 file was a traceback, not a DataError
                raise _not_utf8(local) from None
        elif suffix == ".parquet":
            records = _read_with_datasets("parquet", str(local), "train")
        else:
            raise DataError(path, f"unsupported file type '{suffix}'; expected .json, .jsonl, .parquet or .csv")
    elif local.exists():
        raise DataError(path, "is a directory; expected a .json, .jsonl, .parquet or .csv file")
    elif _looks_like_hub_id(path) and Path(path).suffix.lower() not in _FILE_SUFFIXES:
        records = _read_hub(path, split)
    else:
        raise DataError(path, "file not found (relative paths are resolved from the working directory)")
    return records[:max_samples] if max_samples else records


_FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")

# Found by fuzzing: JSON nested ~1000 levels deep raised RecursionError (in json, or later in anything that walks the
# record, e.g. json.dumps of a tool list) instead of a DataError. No chat record needs more than a few levels.
MAX_NESTING = 100
_TOO_DEEP = f"nested more than {MAX_NESTING} levels deep (no chat record needs that many; is the file corrupted?)"


def nesting_exceeds(value: Any, limit: int = MAX_NESTING) -> bool:
    """Whether lists/objects in `value` nest more than `limit` levels (walked level by level, without recursion)."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(limit):
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (dict, list))]
        if not level:
            return False
    return True


def too_deep(value: Any, text: str, start: int = 0, end: int | None = None) -> bool:
    """`nesting_exceeds` for a value decoded from text[start:end]; counting brackets first spares the walk for
    nearly every record."""
    end = len(text) if end is None else end
    return text.count("[", start, end) + text.count("{", start, end) > MAX_NESTING and nesting_exceeds(value)


def _not_utf8(path: Path) -> DataError:
    """The error for a file that is not UTF-8 text, at the line of its first undecodable byte."""
    data = path.read_bytes()
    body = data[len(codecs.BOM_UTF8) :] if data.startswith(codecs.BOM_UTF8) else data
    try:
        body.decode("utf-8")
        return DataError(str(path), "not UTF-8 text; save the file as UTF-8")
    except UnicodeDecodeError as e:
        before = body[: e.start].decode("utf-8")
        line = before.count("\n") + before.count("\r") - before.count("\r\n") + 1  # \n, \r\n or \r end a line
        return DataError(
            str(path), f"not UTF-8 text (byte 0x{body[e.start]:02x}); save the file as UTF-8 (it may be GBK or Latin-1)", line
        )


def _read_jsonl(path: Path) -> list[Record]:
    records = []
    with path.open(encoding="utf-8-sig") as f:  # -sig: tolerate a UTF-8 byte-order mark (Windows editors write one)
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                data = json.loads(text.rstrip("\r\n"))  # column counts in this line
            except json.JSONDecodeError as e:
                raise DataError(str(path), f"malformed JSON line: {e.msg} (column {e.colno})", number) from None
            except RecursionError:
                raise DataError(str(path), _TOO_DEEP, number) from None
            if too_deep(data, text):
                raise DataError(str(path), _TOO_DEEP, number)
            records.append(Record(data, str(path), number))
    return records


def _read_json(path: Path) -> list[Record]:
    text = path.read_text(encoding="utf-8-sig")
    try:
        return list(_json_array(text, str(path)))
    except json.JSONDecodeError as e:
        raise DataError(str(path), f"malformed JSON: {e.msg} (column {e.colno})", e.lineno) from None


def _json_array(text: str, path: str) -> Iterator[Record]:
    """Decode a top-level JSON array element by element so each record keeps its starting line."""
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos < len(text) and text[pos] == "{":  # a single object, or JSON Lines saved as .json
        line, last = 1, 0
        while pos < len(text):
            obj, end = _decode(decoder, text, pos, path)
            line += text.count("\n", last, pos)
            last = pos
            yield _shallow(Record(obj, path, line), text, pos, end)
            pos = _skip_ws(text, end)
        return
    if pos >= len(text) or text[pos] != "[":
        raise DataError(path, "expected a JSON array of records", text.count("\n", 0, pos) + 1)
    pos = _skip_ws(text, pos + 1)
    line, last = 1, 0
    while pos < len(text) and text[pos] != "]":
        obj, end = _decode(decoder, text, pos, path)
        line += text.count("\n", last, pos)
        last = pos
        yield _shallow(Record(obj, path, line), text, pos, end)
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
        elif pos < len(text) and text[pos] != "]":
            raise json.JSONDecodeError("expected ',' or ']' between records", text, pos)
    if pos >= len(text):  # a truncated file (interrupted download or write) must not pass as complete
        raise json.JSONDecodeError("unterminated array: missing the closing ']' (is the file truncated?)", text, len(text))
    end = _skip_ws(text, pos + 1)
    if end < len(text):
        raise json.JSONDecodeError("unexpected content after the closing ']' of the array", text, end)


def _decode(decoder: json.JSONDecoder, text: str, pos: int, path: str) -> tuple[Any, int]:
    try:
        return decoder.raw_decode(text, pos)
    except RecursionError:
        raise DataError(path, _TOO_DEEP, text.count("\n", 0, pos) + 1) from None


def _shallow(record: Record, text: str, start: int, end: int) -> Record:
    if too_deep(record.data, text, start, end):
        raise record.error(_TOO_DEEP)
    return record


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _read_csv(path: Path) -> list[Record]:
    """CSV with a header row. Every cell stays a string (an all-numeric column must not turn into ints) and an
    empty cell is a missing value (None); each record keeps the line it starts on, even after quoted multi-line cells."""
    records = []
    with path.open(encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            if header is None:
                return []
            start = reader.line_num + 1
            for row in reader:
                if row:  # blank lines are skipped
                    if len(row) != len(header):
                        raise DataError(str(path), f"row has {len(row)} fields but the header has {len(header)}", start)
                    records.append(Record({k: (v if v != "" else None) for k, v in zip(header, row)}, str(path), start))
                start = reader.line_num + 1
        except csv.Error as e:
            raise DataError(str(path), f"malformed CSV: {e}", reader.line_num) from None
    return records


def _read_with_datasets(builder: str, path: str, split: str, header_lines: int = 0) -> list[Record]:
    import datasets

    try:
        table = datasets.load_dataset(builder, data_files=path, split=split)
    except Exception as e:  # datasets raises many types; the user needs the file and the reason
        raise DataError(path, f"could not read {builder} file: {str(e).splitlines()[0]}") from None
    return [Record(row, path, i + 1 + header_lines) for i, row in enumerate(table)]


def _read_hub(repo_id: str, split: str) -> list[Record]:
    """A Hub dataset's split; network hiccups are retried under the same policy as `push` (erniekit_lite/retry.py)."""
    import datasets

    try:
        table = retry.call(lambda: datasets.load_dataset(repo_id, split=split), f"data {repo_id}", _say)
    except retry.GaveUp as failure:  # datasets raises many types; the user needs the id and the reason
        cause = retry.describe(failure.error)
        if retry.transient(failure.error):
            raise DataError(repo_id, f"loading it as a Hub dataset failed {failure.attempts} times ({cause}); "
                            "check the connection (or HF_ENDPOINT) and start again") from None
        raise DataError(repo_id, f"not a local file, and loading it as a Hub dataset failed: {cause}") from None
    return [Record(row, f"{repo_id}[{split}]", i + 1) for i, row in enumerate(table)]


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # read_records has no log: a retry is worth a line on any caller's console


def _looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~")) and "." not in parts[0]
