"""Property-based fuzzing (hypothesis) of the data pipeline: readers, record formats, chat renderer and label
masker, overlong handling, packing and collation.

Every generated input must end as either
  * valid samples whose labels cover exactly the response tokens: `labels == input_ids` on each trained response,
    `</s>` (the eos) on each trained `<|end_of_sentence|>`, -100 everywhere else; the trained span decodes back to
    the assistant's text (with its tool calls), and control ids appear only where the template puts them
    (text that spells `<|end_of_sentence|>` never becomes id 100272), or
  * a `DataError` (a `UserError`) that names `file:line` of the offending record,
and never any other exception. Records go through the real readers (temp .json/.jsonl/.csv/.parquet files) and,
where practical, `prepare()` / `prepare_pairs()`.

The expected rendering (`render` below) is written from the documented template, independently of template.py:
    <|begin_of_sentence|>{system}\\n  then per turn  User: {q}\\nAssistant: | {a} | <|end_of_sentence|>
with each text tokenized on its own, special-token parsing off.

Runs are derandomized (the same examples on every run, so CI is deterministic) and kept small (~1 min on 2 cores).
Explore further with ERNIEKIT_FUZZ_SCALE=10 (ten times the examples) and ERNIEKIT_FUZZ_RANDOM=1 (new random
examples each run); add any failure found that way as an `@example`.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, event, example, given, note, settings
from hypothesis import strategies as st

from erniekit_lite.data.collate import PackedCollator, PaddedCollator
from erniekit_lite.data.formats import (
    Conversation,
    Preference,
    Skip,
    Turn,
    check_format,
    detect_format,
    detect_preference_format,
    to_conversation,
    to_preference,
)
from erniekit_lite.data.load import MAX_NESTING, Record, read_records
from erniekit_lite.data.packing import best_fit_decreasing, one_per_row, pack
from erniekit_lite.data.pairs import Pair, PackedPairCollator, PaddedPairCollator, pack_pairs
from erniekit_lite.data.prepare import prepare, prepare_pairs
from erniekit_lite.data.template import ErnieTemplate, template_for
from erniekit_lite.data.tokenize import IGNORE, Sample, Tokenizer
from erniekit_lite.errors import DataError, UserError
from erniekit_lite.recipe import FORMATS, DataSection
from erniekit_lite.data.collate import labelled_positions

from test_tokenize import CHATML, CHATML_TOOLS, THINKING_STYLE  # tests/ is on sys.path under pytest
from test_tool_calls import CONTROL, DROPS_REASONING, THINKING_TEMPLATE

SCALE = float(os.environ.get("ERNIEKIT_FUZZ_SCALE", "1"))
RANDOM = os.environ.get("ERNIEKIT_FUZZ_RANDOM") == "1"


def fuzz(examples: int):
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        derandomize=not RANDOM,
        database=None,  # nothing written into the tree; failures are kept as @example instead
        suppress_health_check=[
            HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much, HealthCheck.large_base_example,
        ],
    )


# ---------------------------------------------------------------------------------------------------------------
# Strategies: nasty text and junk values
# ---------------------------------------------------------------------------------------------------------------

# the control tokens of ERNIE 4.5 (and of other templates) spelled as text, and other characters that break naive code
SPECIALS = [
    "<|end_of_sentence|>", "<|begin_of_sentence|>", "</s>", "<s>", "<unk>", "<|im_start|>", "<|im_end|>", "<mask:1>",
    "<mask:7>", "<think>", "</think>", "User: ", "\nAssistant: ", "Assistant:", "▁", "<0x0A>", "\r\n", "\r", "\n",
    "\x00", "\x85", "\u2028", "\ufeff", "\u200b", "\t", "\x1b[0m", "🙂", "👨\u200d👩\u200d👧", "你好，世界。", "𠀀", "ﬁ", "e\u0301",
    "\\u0000", '"', "\\", "{", "]", ",", "NaN", " ", "  ",
]
_chars = st.characters(exclude_categories=("Cs",))  # any code point but surrogates: controls, CJK, emoji, private use
_chunk = st.one_of(
    st.text(_chars, max_size=10),
    st.text(st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF), min_size=1, max_size=6),  # CJK
    st.text(st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF), min_size=1, max_size=3),  # emoji
    st.sampled_from(SPECIALS),
)
small_text = st.lists(_chunk, max_size=5).map("".join)
huge_text = st.builds(lambda s, n: (s[:24] or "x") * n, small_text, st.integers(40, 100))  # up to ~2.4k characters
text = st.one_of(small_text, small_text, small_text, st.just(""), huge_text)
nonempty = st.builds(  # text with at least one character that str.strip() keeps
    lambda a, core, b: a + core + b,
    small_text,
    st.one_of(st.text(st.characters(categories=["L", "N", "P", "S"]), min_size=1, max_size=6), st.sampled_from(SPECIALS[:5])),
    st.one_of(small_text, huge_text),
)

KEYS = [
    "src", "tgt", "label", "system", "instruction", "input", "output", "history", "conversations", "from", "value",
    "messages", "role", "content", "tool_calls", "tools", "function", "name", "arguments", "type", "text",
    "loss_weight", "response", "sort", "prompt", "chosen", "rejected", "question", "human", "gpt", "user", "assistant",
]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True), small_text,
    st.sampled_from(KEYS + ["human", "gpt", "function_call", "observation", "tool"]),
)
junk = st.recursive(
    scalars,
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(st.one_of(st.sampled_from(KEYS), small_text), kids, max_size=3)),
    max_leaves=8,
)


def nest(depth: int, kind: str = "list") -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


deep_junk = st.builds(nest, st.integers(1, 60), st.sampled_from(["list", "dict"]))
any_junk = st.one_of(junk, junk, deep_junk)


def same_json(a, b) -> bool:
    """Equality that treats NaN as equal to itself (records may hold NaN)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def line_breaks(s: str) -> int:
    """Line breaks as editors and universal-newline reading count them."""
    return len(re.findall(r"\r\n|\r|\n", s))


_names = itertools.count()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def write_file(workdir: Path, suffix: str, content: str | bytes) -> str:
    path = workdir / f"f{next(_names)}{suffix}"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8", newline="")  # newline="": the line endings exactly as generated
    return str(path)


def jsonl_text(records: list, draw=None) -> tuple[str, list[int]]:
    """Records as JSON Lines with random blank lines and line endings; returns the text and each record's line.
    Without `draw` (explicit examples): one record per line, no blank lines."""
    parts, lines, line = [], [], 1
    for r in records:
        for _ in range(draw(st.integers(0, 1)) if draw else 0):
            parts.append(draw(st.sampled_from(["", "  ", "\t"])) + draw(st.sampled_from(["\n", "\r\n"])))
            line += 1
        ascii_, end = (draw(st.booleans()), draw(st.sampled_from(["\n", "\r\n"]))) if draw else (False, "\n")
        parts.append(json.dumps(r, ensure_ascii=ascii_) + end)
        lines.append(line)
        line += 1
    return "".join(parts), lines


class _Fixed:
    """Stands in for st.data() in an explicit @example: each draw returns the next of the given values."""

    def __init__(self, values: list):
        self.values = list(values)

    def draw(self, strategy, label=None):
        if self.values:
            return self.values.pop(0)
        raise AssertionError(f"no value given for {strategy!r}")


def assert_names_line(error: DataError, path: str, lines):
    """A DataError for a record: `path:line: message`, one line, line among the expected ones."""
    assert isinstance(error, UserError)
    assert error.path == path and error.line in lines, (str(error), lines)
    assert str(error).startswith(f"{path}:{error.line}: ")


# ---------------------------------------------------------------------------------------------------------------
# Tokenizers: the real ERNIE 4.5 one (../shared) and the project's own tiny byte-level one
# ---------------------------------------------------------------------------------------------------------------


class CachedVocab:
    """The tokenizer, with `get_vocab()` computed once: on ERNIE's 101k-entry vocabulary it takes ~0.1 s, and
    prepare() calls it (through template_for) on every run."""

    def __init__(self, tokenizer):
        self._tokenizer, self._vocab = tokenizer, tokenizer.get_vocab()

    def get_vocab(self) -> dict:
        return self._vocab

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)


class Tok:
    """A tokenizer with the ids the checks need (a plain class: hypothesis prints it in reports as its name)."""

    def __init__(self, name: str, tokenizer):
        tokenizer = CachedVocab(tokenizer)
        template = template_for(tokenizer)
        assert isinstance(template, ErnieTemplate)
        vocab = tokenizer.get_vocab()
        self.name, self.tokenizer, self.tokenize = name, tokenizer, Tokenizer(tokenizer, template)
        self.bos, self.eot, self.eos = vocab["<|begin_of_sentence|>"], vocab["<|end_of_sentence|>"], vocab["</s>"]
        self.special = frozenset(tokenizer.all_special_ids) | {self.bos, self.eot, self.eos}  # never from user text
        self._encoded: dict[str, list[int]] = {}

    def __repr__(self) -> str:
        return f"Tok({self.name})"

    def enc(self, text: str) -> list[int]:
        if text not in self._encoded:  # the oracle renders the same texts many times (truncation tries each tail)
            if len(self._encoded) > 20_000:
                self._encoded.clear()
            self._encoded[text] = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return list(self._encoded[text])

    def dec(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def as_decoded(self, text: str) -> str:
        # ERNIE's SentencePiece normaliser writes " " as "▁", so a literal "▁" decodes as a space
        return text.replace("▁", " ") if self.name == "ernie" else text


@pytest.fixture(scope="module")
def tiny_tok() -> Tok:
    from erniekit_lite.tiny import build_tokenizer

    return Tok("tiny", build_tokenizer())


@pytest.fixture(scope="module")
def ernie_tok(ernie_tokenizer) -> Tok:
    tok = Tok("ernie", ernie_tokenizer)
    assert (tok.bos, tok.eot, tok.eos) == (100273, 100272, 2)
    return tok


@pytest.fixture(scope="module", params=["ernie", "tiny"])
def tok(request) -> Tok:
    return request.getfixturevalue(f"{request.param}_tok")


# ---------------------------------------------------------------------------------------------------------------
# The expected rendering, from the documented template, and the sample checks
# ---------------------------------------------------------------------------------------------------------------


def answer_text(turn: Turn) -> str:
    if not turn.tool_calls:
        return turn.assistant
    calls = json.dumps(turn.tool_calls, ensure_ascii=False)
    return f"{turn.assistant}\n{calls}" if turn.assistant else calls


def system_line(conv: Conversation) -> str | None:
    system = conv.system
    if conv.tools:
        tools = "Tools: " + json.dumps(conv.tools, ensure_ascii=False)
        system = f"{system}\n\n{tools}" if system else tools
    return system


@dataclass
class Rendered:
    ids: list[int]
    labels: list[int]
    spans: list[tuple[int, int, str, bool]]  # per turn: response start, end (after the end-of-turn), text, trained
    prompt_length: int  # of the first turn


def render(tok: Tok, conv: Conversation) -> Rendered:
    system = system_line(conv)
    ids, labels, spans, first_prompt = [tok.bos], [IGNORE], [], 0
    for i, turn in enumerate(conv.turns):
        head = f"{system}\n" if i == 0 and system else ""
        prompt = tok.enc(f"{head}User: {turn.user}\nAssistant: ")
        ids += prompt
        labels += [IGNORE] * len(prompt)
        if i == 0:
            first_prompt = len(ids)
        answer = answer_text(turn)
        response = tok.enc(answer)
        start = len(ids)
        ids += response + [tok.eot]
        labels += response + [tok.eos] if turn.train else [IGNORE] * (len(response) + 1)
        spans.append((start, len(ids), answer, turn.train))
    return Rendered(ids, labels, spans, first_prompt)


def check_control_ids(tok: Tok, ids: list[int], spans):
    """Control ids only where the template puts them: BOS first, one end-of-turn closing each response."""
    where = [j for j, t in enumerate(ids) if t in tok.special]
    ends = [end - 1 for _, end, _, _ in spans if end <= len(ids)]
    assert where == [0] + ends, f"control ids at {where}, template puts them at {[0] + ends}"
    assert ids[0] == tok.bos and all(ids[j] == tok.eot for j in ends)


def check_labels(tok: Tok, sample: Sample):
    assert len(sample.labels) == len(sample.input_ids) >= 1
    assert sample.labels[0] == IGNORE  # a sample starts untrained: packed rows never train across samples
    for t, label in zip(sample.input_ids, sample.labels):
        assert label == IGNORE or label == t or (t == tok.eot and label == tok.eos)


def check_sample(tok: Tok, conv: Conversation, sample: Sample):
    """`sample` is exactly `conv` rendered: ids, labels on the trained responses only, decodable spans."""
    want = render(tok, conv)
    check_labels(tok, sample)
    assert sample.input_ids == want.ids
    assert sample.labels == want.labels
    check_control_ids(tok, sample.input_ids, want.spans)
    trained = set()
    for start, end, answer, train in want.spans:
        if train:
            assert sample.labels[end - 1] == tok.eos  # the end-of-turn is labelled </s>
            assert tok.dec(sample.labels[start : end - 1]) == tok.as_decoded(answer)
            trained.update(range(start, end))
    assert {j for j, label in enumerate(sample.labels) if label != IGNORE} == trained


# ---------------------------------------------------------------------------------------------------------------
# 1. Readers: .jsonl / .json / .csv / .parquet keep every record and its line; anything broken is a DataError
# ---------------------------------------------------------------------------------------------------------------


@fuzz(30)
@given(data=st.data(), records=st.lists(any_junk, max_size=6))
def test_jsonl_round_trip_and_lines(workdir, data, records):
    text, lines = jsonl_text(records, data.draw)
    bom = data.draw(st.sampled_from(["", "\ufeff"]))
    path = write_file(workdir, ".jsonl", bom + text)
    got = read_records(path)
    assert [r.line for r in got] == lines
    assert all(same_json(r.data, want) for r, want in zip(got, records)) and len(got) == len(records)
    assert all(r.path == path for r in got)


@fuzz(30)
@given(data=st.data(), records=st.lists(junk, min_size=1, max_size=5), bad=st.text(_chars, min_size=1, max_size=20))
def test_jsonl_malformed_line_is_named(workdir, data, records, bad):
    bad = bad.replace("\r", "").replace("\n", "").lstrip("\ufeff")
    assume(bad.strip())
    try:
        json.loads(bad)
        assume(False)  # valid JSON is not malformed
    except ValueError:
        pass
    at = data.draw(st.integers(0, len(records)))
    before, _ = jsonl_text(records[:at], data.draw)
    text = before + bad + "\n" + "".join(json.dumps(r) + "\n" for r in records[at:])
    path = write_file(workdir, ".jsonl", text)
    with pytest.raises(DataError) as e:
        read_records(path)
    assert_names_line(e.value, path, [1 + line_breaks(before)])
    assert "malformed JSON line" in str(e.value)


@fuzz(30)
@given(data=st.data(), records=st.lists(any_junk, max_size=5), stream=st.booleans())
def test_json_array_or_object_stream_round_trip_and_lines(workdir, data, records, stream):
    """A JSON array (or objects one after another: JSON Lines saved as .json), with random layout."""
    sep = st.sampled_from(["", " ", "\n", "\r\n", "\t", "\n\n", " \n  "])
    if stream:
        records = [r if isinstance(r, dict) else {"value": r} for r in records]
        assume(records)
    text, lines = data.draw(sep), []
    text = "" if stream else "[" + text
    for i, r in enumerate(records):
        if i and not stream:
            text += data.draw(sep) + "," + data.draw(sep)
        elif i:
            text += data.draw(sep)
        lines.append(1 + line_breaks(text))
        text += json.dumps(r, ensure_ascii=data.draw(st.booleans()), indent=data.draw(st.sampled_from([None, 0, 2])))
    text += "" if stream else data.draw(sep) + "]"
    text += data.draw(sep)
    path = write_file(workdir, ".json", data.draw(st.sampled_from(["", "\ufeff"])) + text)
    got = read_records(path)
    assert [r.line for r in got] == lines
    assert len(got) == len(records) and all(same_json(r.data, want) for r, want in zip(got, records))


@fuzz(30)
@given(data=st.data(), records=st.lists(junk, min_size=1, max_size=4))
@example(data=_Fixed([None, 9, "insert", ","]), records=[{"a": 1}]).via("a trailing comma is tolerated")
@example(data=_Fixed([None, 1, "insert", ","]), records=[{"a": 1}]).via("a leading comma is not")
def test_json_truncated_or_corrupted_is_a_data_error(workdir, data, records):
    text = json.dumps(records, indent=data.draw(st.sampled_from([None, 2])), ensure_ascii=False)
    cut = data.draw(st.integers(0, len(text) - 1))
    broken = data.draw(st.sampled_from(["cut", "insert", "trail"]))
    if broken == "cut":
        text = text[:cut]
    elif broken == "insert":
        text = text[:cut] + data.draw(st.sampled_from(["}", "{", ",", "]", "x", '"', ":", "[}"])) + text[cut:]
    else:
        text += data.draw(st.sampled_from(["x", "[]", "{}", ","]))
    path = write_file(workdir, ".json", text)
    try:
        got = read_records(path)
    except DataError as e:  # the usual outcome; it names a line of the file
        assert e.path == path and 1 <= e.line <= 1 + line_breaks(text), str(e)
        return
    # accepted only if it still is a JSON array (one trailing comma is tolerated, as hand-edited files have them)
    assert same_json([r.data for r in got], json.loads(re.sub(r",(\s*)\]\s*$", r"\1]", text)))


CSV_COLUMNS = ["instruction", "input", "output", "system", "src", "tgt", "x", "列", ""]


@fuzz(30)
@given(
    data=st.data(),
    header=st.lists(st.sampled_from(CSV_COLUMNS) | small_text, min_size=1, max_size=4, unique=True),
    terminator=st.sampled_from(["\r\n", "\n"]),
)
@example(data=None, header=["instruction", "input"], terminator="\n").via("a lone \\r in a cell, with \\n line ends")
def test_csv_round_trip_and_lines(workdir, data, header, terminator):
    """Cells with newlines, quotes, commas, NULs, CJK: each row comes back as strings (empty -> None) with its line."""
    if data is None:
        data = _Fixed([[["", "\r"], ["x\ry", "\r\n"]], False, ""])  # rows, not ragged, no BOM
    rows = data.draw(st.lists(st.lists(text, min_size=len(header), max_size=len(header)), max_size=5))
    # csv.writer with "\n" line ends leaves a lone "\r" unquoted (its output would not read back): quote everything then
    quoting = csv.QUOTE_ALL if terminator == "\n" else data.draw(st.sampled_from([csv.QUOTE_MINIMAL, csv.QUOTE_ALL]))
    out = io.StringIO(newline="")
    writer = csv.writer(out, lineterminator=terminator, quoting=quoting)
    writer.writerow(header)
    lines = []
    for row in rows:
        lines.append(1 + line_breaks(out.getvalue()))
        writer.writerow(row)
    ragged = data.draw(st.booleans()) and rows
    if ragged:  # a row with a missing or extra field, somewhere
        at = data.draw(st.integers(0, len(rows) - 1))
        out = io.StringIO(newline="")
        writer = csv.writer(out, lineterminator=terminator, quoting=quoting)
        writer.writerow(header)
        for i, row in enumerate(rows):
            writer.writerow(row + ["extra"] if i == at else row)
    path = write_file(workdir, ".csv", data.draw(st.sampled_from(["", "\ufeff"])) + out.getvalue())
    if ragged:
        with pytest.raises(DataError) as e:
            read_records(path)
        assert_names_line(e.value, path, [lines[at]])
        return
    got = read_records(path)
    assert [r.line for r in got] == lines
    for r, row in zip(got, rows):
        assert r.data == {k: (v if v != "" else None) for k, v in zip(header, row)}


@fuzz(10)
@given(rows=st.lists(st.fixed_dictionaries({"instruction": st.none() | text, "output": st.none() | text, "n": st.none() | st.floats()}), min_size=1, max_size=5))
def test_parquet_round_trip(workdir, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(workdir / f"f{next(_names)}.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    got = read_records(path)
    assert [r.line for r in got] == list(range(1, len(rows) + 1))
    assert all(same_json(r.data, row) for r, row in zip(got, rows))


@fuzz(25)
@given(
    data=st.data(),
    suffix=st.sampled_from([".jsonl", ".json", ".csv"]),
    junk_bytes=st.binary(min_size=1, max_size=8),
)
@example(data=None, suffix=".jsonl", junk_bytes=b"\xff").via("a GBK/Latin-1 file is not a traceback")
@example(data=None, suffix=".csv", junk_bytes=b"\r\n\x80").via("line ends before the bad byte count")
def test_files_that_are_not_utf8_are_a_data_error(workdir, data, suffix, junk_bytes):
    try:
        junk_bytes.decode("utf-8")
        assume(False)
    except UnicodeDecodeError as e:
        breaks_before = line_breaks(junk_bytes[: e.start].decode("utf-8"))  # the random bytes may hold line ends too
    good = '{"instruction": "q", "output": "a"}' if suffix != ".csv" else "instruction,output\r\nq,a"
    before = (data.draw(st.integers(0, 3)) if data else 2)
    head = "\n".join([good] * before) + ("\n" if before else "")
    if suffix == ".json" and head:
        head = ""  # a JSON array cannot hold raw lines; put the bad bytes at the start
    content = head.encode() + b'{"x": "' + junk_bytes + b'"}\n'
    path = write_file(workdir, suffix, content)
    with pytest.raises(DataError) as e:
        read_records(path)
    assert e.value.path == path and "UTF-8" in str(e.value)
    assert e.value.line == 1 + head.count("\n") + breaks_before, str(e.value)


@fuzz(20)
@given(
    depth=st.one_of(st.integers(1, 5000), st.integers(MAX_NESTING - 10, MAX_NESTING + 10)),
    suffix=st.sampled_from([".jsonl", ".json"]),
    where=st.sampled_from(["record", "field", "tools", "call"]),
)
@example(depth=3000, suffix=".jsonl", where="record")
@example(depth=3000, suffix=".json", where="field")
@example(depth=950, suffix=".jsonl", where="tools")
@example(depth=3000, suffix=".jsonl", where="call")
def test_deeply_nested_records_are_a_data_error(workdir, ernie_tok, depth, suffix, where):
    """Nesting deep enough to exhaust Python's recursion (in the reader, or later when the record is rendered)."""
    deep = "[" * depth + "]" * depth
    good = '{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}'
    bad = {
        "record": deep,
        "field": '{"conversations": [{"from": "human", "value": ' + deep + '}, {"from": "gpt", "value": "a"}]}',
        "tools": good[:-1] + ', "tools": [{"name": "f", "parameters": ' + deep + "}]}",
        "call": '{"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": '
        + json.dumps('{"name": "f", "arguments": ' + deep + "}") + "}]}",
    }[where]
    text = good + "\n" + bad + "\n" if suffix == ".jsonl" else "[" + good + ",\n" + bad + "]"
    path = write_file(workdir, suffix, text)
    try:
        records = read_records(path)
        for record in records:
            fmt = detect_format(record)
            check_format(record, fmt)
            conv = to_conversation(record, fmt)
            samples, _ = ernie_tok.tokenize([conv], 10**6)
            assert samples[0] is not None
    except DataError as e:
        assert_names_line(e, path, [2])
        assert where == "record" or depth > MAX_NESTING - 5, f"refused a record nested only {depth} levels: {e}"
        assert where == "record" or "nested more than" in str(e)
        return
    assert where != "record" and depth <= MAX_NESTING, f"accepted a record nested {depth} levels"


# ---------------------------------------------------------------------------------------------------------------
# 2. SFT record formats: generated records with a known meaning, junk, and mutations
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Spec:
    fmt: str
    record: Any
    expected: Any  # Conversation (its system before the recipe default), Preference, or a Skip reason (str)
    junk: bool = False
    tools: list = field(default_factory=list)  # preference records: the schemas that follow the system prompt


def maybe(strategy):
    return st.one_of(st.none(), strategy)


@st.composite
def erniekit_sft(draw):
    n = draw(st.integers(1, 3))
    src, tgt = draw(st.lists(text, min_size=n, max_size=n)), draw(st.lists(text, min_size=n, max_size=n))
    labels = draw(maybe(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n)))
    system = draw(st.one_of(st.none(), st.just(""), text))
    record: dict = {"src": src, "tgt": tgt} if n > 1 or draw(st.booleans()) else {"src": src[0], "tgt": tgt[0]}
    if labels is not None:
        record["label"] = labels
    if system is not None:
        record["system"] = system
    turns = [Turn(q, a, bool(l)) for q, a, l in zip(src, tgt, labels or [1] * n)]
    return Spec("erniekit", record, Conversation(turns, system or None))


@st.composite
def alpaca_sft(draw):
    instruction, output = draw(text), draw(text)
    record: dict = {"instruction": instruction, "output": output}
    extra = draw(st.one_of(st.none(), st.just(""), text))
    if extra is not None or draw(st.booleans()):
        record["input"] = extra
    system = draw(st.one_of(st.none(), st.just(""), text))
    if system is not None:
        record["system"] = system
    history = draw(maybe(st.lists(st.tuples(text, text).map(list), max_size=2)))
    if history is not None:
        record["history"] = history
    turns = [Turn(q, a) for q, a in history or []] + [Turn(f"{instruction}\n{extra}" if extra else instruction, output)]
    return Spec("alpaca", record, Conversation(turns, system or None))


@st.composite
def content(draw, allow_object: bool = True):
    """A message content in one of its accepted shapes -> (raw value, the text it stands for)."""
    kind = draw(st.sampled_from(["str", "str", "parts"] + (["object"] if allow_object else [])))
    if kind == "str":
        s = draw(text)
        return s, s
    if kind == "object":  # e.g. a tool result object: kept as JSON text
        obj = {draw(st.sampled_from(["result", "temp"])): draw(st.one_of(small_text, st.integers(), st.floats(allow_nan=False)))}
        return obj, json.dumps(obj, ensure_ascii=False)
    parts = draw(st.lists(small_text, min_size=1, max_size=3))
    shape = draw(st.sampled_from([lambda s: {"type": "text", "text": s}, lambda s: {"type": "text", "value": s}, lambda s: {"text": s}]))
    return [shape(s) for s in parts], "".join(parts)


tool_names = st.one_of(small_text, st.sampled_from(["get_weather", "search", "天气", "</s>"]))
arguments = st.one_of(st.dictionaries(small_text, st.one_of(small_text, st.integers(), st.booleans()), max_size=2), small_text)


@st.composite
def tool_call(draw):
    """(raw call as the record holds it, the call as chat templates read it)."""
    name, args = draw(tool_names), draw(arguments)
    shape = draw(st.sampled_from(["bare", "wrapped", "id"]))
    if shape == "bare":
        raw = {"name": name, "arguments": args}
        return raw, {"type": "function", "function": raw}
    raw = {"type": "function", "function": {"name": name, "arguments": args}}
    if shape == "id":
        raw = {"id": draw(small_text), **raw}
    return raw, raw


tool_schemas = st.lists(
    st.fixed_dictionaries({"name": tool_names}, optional={"description": text, "parameters": st.dictionaries(small_text, small_text, max_size=2)}),
    min_size=1, max_size=2,
)


@st.composite
def tools_field(draw):
    """(raw `tools` value or absent, the schemas it stands for)."""
    kind = draw(st.sampled_from(["absent", "empty", "list", "json"]))
    if kind == "absent":
        return None, []
    if kind == "empty":
        return draw(st.sampled_from([[], "[]", "", " [] ", None])), []
    schemas = draw(tool_schemas)
    return (schemas if kind == "list" else json.dumps(schemas, ensure_ascii=draw(st.booleans()))), schemas


USER_FROM, TOOL_FROM, GPT_FROM = ["human", "user"], ["observation", "tool", "function"], ["gpt", "assistant", "bot"]


@st.composite
def sharegpt_sft(draw):
    record_system = draw(st.one_of(st.none(), st.just(""), text))
    system = record_system or None
    messages = []
    if draw(st.booleans()):
        s = draw(text)
        messages.append({"from": "system", "value": s})
        system = s if system is None else f"{system}\n{s}"
    turns = []
    for i in range(draw(st.integers(1, 3))):
        users, tool_only = [], True
        for _ in range(draw(st.integers(1, 2))):
            role = draw(st.sampled_from(USER_FROM + (TOOL_FROM if i else [])))
            raw, s = draw(content())
            messages.append({"from": role, "value": raw})
            users.append(s)
            tool_only &= role in TOOL_FROM
        texts, calls = [], []
        if draw(st.booleans()):
            raw, s = draw(content(allow_object=False))
            messages.append({"from": draw(st.sampled_from(GPT_FROM)), "value": raw})
            texts.append(s)
        for _ in range(draw(st.integers(0 if texts else 1, 2))):
            group = draw(st.lists(tool_call(), min_size=1, max_size=2))
            value = [raw for raw, _ in group] if len(group) > 1 or draw(st.booleans()) else group[0][0]
            messages.append({"from": "function_call", "value": json.dumps(value, ensure_ascii=draw(st.booleans()))})
            calls += [wrapped for _, wrapped in group]
        turns.append(Turn("\n".join(u for u in users if u), "\n".join(t for t in texts if t), True, calls, tool_only))
    if draw(st.booleans()):  # a trailing prompt without an answer is dropped
        messages.append({"from": "human", "value": draw(text)})
    record: dict = {"conversations": messages}
    if record_system is not None:
        record["system"] = record_system
    raw_tools, schemas = draw(tools_field())
    if raw_tools is not None or draw(st.booleans()):
        record["tools"] = raw_tools
    return Spec("sharegpt", record, Conversation(turns, system, schemas))


@st.composite
def messages_sft(draw):
    system, messages, turns = None, [], []
    for _ in range(draw(st.integers(0, 2))):
        raw, s = draw(content(allow_object=False))
        messages.append({"role": "system", "content": raw})
        system = s if system is None else f"{system}\n{s}"
    for i in range(draw(st.integers(1, 3))):
        users, tool_only = [], True
        for _ in range(draw(st.integers(1, 2))):
            role = draw(st.sampled_from(["user"] + (["tool", "function", "observation"] if i else [])))
            raw, s = draw(content())
            messages.append({"role": role, "content": raw})
            users.append(s)
            tool_only &= role != "user"
        texts, calls, trained = [], [], True
        for j in range(draw(st.integers(1, 2))):
            message: dict = {"role": "assistant"}
            group = draw(st.lists(tool_call(), max_size=2))
            if group:
                message["tool_calls"] = [raw for raw, _ in group]
                calls += [wrapped for _, wrapped in group]
            if group and draw(st.booleans()):
                if draw(st.booleans()):
                    message["content"] = None
            else:
                raw, s = draw(content(allow_object=False))
                message["content"] = raw
                texts.append(s)
            weight = draw(st.sampled_from([None, 1, 1.0, 0, 0.0]))
            if weight is not None:
                message["loss_weight"] = weight
                trained &= weight != 0
            messages.append(message)
        turns.append(Turn("\n".join(u for u in users if u), "\n".join(t for t in texts if t), trained, calls, tool_only))
    if draw(st.booleans()):
        messages.append({"role": "user", "content": draw(text)})
    record: dict = {"messages": messages}
    raw_tools, schemas = draw(tools_field())
    if raw_tools is not None:
        record["tools"] = raw_tools
    return Spec("messages", record, Conversation(turns, system, schemas))


SFT_SPECS = {"erniekit": erniekit_sft(), "alpaca": alpaca_sft(), "sharegpt": sharegpt_sft(), "messages": messages_sft()}
sft_spec = st.one_of(*SFT_SPECS.values())


@dataclass
class Refused:
    """A record that must be refused: a DataError for its line whose message holds `fragment`."""

    fragment: str


non_str = st.one_of(
    st.integers(), st.floats(), st.booleans(), st.lists(small_text, max_size=2), st.dictionaries(small_text, small_text, max_size=2)
)
not_json = small_text.filter(lambda s: not _parses(s))


def _parses(s: str) -> bool:
    try:
        json.loads(s)
        return True
    except ValueError:
        return False


def _copy(record):
    return json.loads(json.dumps(record))


def _messages_of(spec: Spec) -> tuple[list, str, str]:
    """The message list of a sharegpt/messages record, its role key and content key."""
    if spec.fmt == "sharegpt":
        return spec.record["conversations"], "from", "value"
    return spec.record["messages"], "role", "content"


SFT_BREAKS = [
    "system", "src_tgt", "label", "str_list", "alpaca_field", "history", "role", "first_assistant", "no_turn",
    "function_call", "tool_calls", "content", "tools", "message_shape", "not_a_list",
]


@st.composite
def refused_sft(draw, case: str | None = None):
    """A well-formed SFT record broken in one known way, with the message the DataError must hold."""
    case = case or draw(st.sampled_from(SFT_BREAKS))
    if case == "system":
        spec = draw(st.one_of(erniekit_sft(), alpaca_sft(), sharegpt_sft()))
        record = _copy(spec.record)
        record["system"] = draw(non_str)
        return Spec(spec.fmt, record, Refused("field 'system' must be a string"))
    if case == "src_tgt":
        n, m = draw(st.tuples(st.integers(0, 3), st.integers(0, 3)).filter(lambda t: t[0] != t[1]))
        record = {"src": draw(st.lists(text, min_size=n, max_size=n)), "tgt": draw(st.lists(text, min_size=m, max_size=m))}
        return Spec("erniekit", record, Refused(f"'src' has {n} turns but 'tgt' has {m}"))
    if case == "label":
        spec = draw(erniekit_sft())
        record = _copy(spec.record)
        n = len(record["src"]) if isinstance(record["src"], list) else 1
        bad = st.sampled_from([2, -1, "1", None, math.nan, 0.5, [1], {}])
        record["label"] = draw(st.one_of(
            st.lists(st.sampled_from([0, 1]), max_size=4).filter(lambda l: len(l) != n),  # one per turn, or wrong
            st.builds(lambda good, b, at: good[:at] + [b] + good[at + 1 :], st.just([1] * n), bad, st.integers(0, n - 1)),
            st.sampled_from(["1", 1, {"a": 1}, "0,1"]),
        ))
        return Spec("erniekit", record, Refused("'label' must be a list of 0/1"))
    if case == "str_list":
        spec = draw(erniekit_sft())
        record = _copy(spec.record)
        key = draw(st.sampled_from(["src", "tgt"]))
        value = record[key] if isinstance(record[key], list) else [record[key]]
        at = draw(st.integers(0, len(value) - 1))
        record[key] = draw(st.one_of(
            st.builds(lambda b: value[:at] + [b] + value[at + 1 :], non_str.filter(lambda v: not isinstance(v, str)) | st.none()),
            st.one_of(st.none(), st.integers(), st.dictionaries(small_text, small_text, max_size=1)),
        ))
        return Spec("erniekit", record, Refused(f"field '{key}' must be a list of strings"))
    if case == "alpaca_field":
        spec = draw(alpaca_sft())
        record = _copy(spec.record)
        key = draw(st.sampled_from(["instruction", "output", "input"]))
        if key != "input" and draw(st.booleans()):
            del record[key]
            return Spec("alpaca", record, Refused(f"missing field '{key}'"))
        record[key] = draw(non_str)
        return Spec("alpaca", record, Refused(f"field '{key}' must be a string"))
    if case == "history":
        spec = draw(alpaca_sft())
        record = _copy(spec.record)
        record["history"] = draw(st.sampled_from([[["q"]], [["q", "a", "b"]], "q", {"q": "a"}, [["q", 1]], [[None, "a"]], [["q", "a"], "x"]]))
        return Spec("alpaca", record, Refused("'history' must"))
    if case == "function_call":
        value = draw(st.one_of(
            not_json.map(lambda s: (s, "expected JSON")),
            st.sampled_from(['{"arguments": {}}', '{"name": 1}', "[1]", '"f"', "1", '{"function": "f"}', '[{"name": "f"}, 2]']).map(
                lambda s: (s, "a tool call must hold")
            ),
        ))
        record = {"conversations": [{"from": "human", "value": draw(text)}, {"from": "function_call", "value": value[0]}]}
        return Spec("sharegpt", record, Refused(value[1]))
    if case == "tool_calls":
        calls = draw(st.sampled_from([[{"function": "f"}], "xyz", [1], {"name": 5}, [{"name": None, "arguments": {}}]]))
        record = {"messages": [{"role": "user", "content": draw(text)}, {"role": "assistant", "tool_calls": calls}]}
        return Spec("messages", record, Refused("a tool call must hold"))
    if case == "content":
        spec = draw(messages_sft())
        record = _copy(spec.record)
        at = draw(st.sampled_from([i for i, m in enumerate(record["messages"]) if m["role"] != "assistant"]))
        bad = draw(st.one_of(
            st.one_of(st.integers(), st.floats(), st.booleans()).map(lambda v: (v, "expected a string")),
            st.sampled_from([[{"type": "image_url", "image_url": "x"}], ["text"], [5], [{"type": "text", "text": 5}]]).map(
                lambda v: (v, "unsupported content part")
            ),
        ))
        record["messages"][at]["content"] = bad[0]
        return Spec("messages", record, Refused(bad[1]))
    if case == "tools":
        spec = draw(st.one_of(sharegpt_sft(), messages_sft()))
        record = _copy(spec.record)
        record["tools"] = draw(st.sampled_from([{"name": "f"}, ["f"], [1], '{"name": "f"}', "[1]", "[{name: f}]", "not json", 5, True]))
        return Spec(spec.fmt, record, Refused("tools"))
    if case == "not_a_list":
        key, fmt = draw(st.sampled_from([("conversations", "sharegpt"), ("messages", "messages")]))
        return Spec(fmt, {key: draw(st.one_of(small_text, st.integers(), st.dictionaries(small_text, small_text, min_size=1, max_size=1)))}, Refused(f"'{key}' must be a list"))
    spec = draw(st.one_of(sharegpt_sft(), messages_sft()))
    record = _copy(spec.record)
    messages, role_key, content_key = _messages_of(Spec(spec.fmt, record, None))
    if case == "role":
        at = draw(st.integers(0, len(messages) - 1))
        known = set(USER_FROM + TOOL_FROM + GPT_FROM + ["system", "function_call", "user", "assistant", "tool"])
        messages[at][role_key] = draw(st.one_of(small_text.filter(lambda r: r not in known), non_str))
        return Spec(spec.fmt, record, Refused("unknown role"))
    if case == "first_assistant":
        messages.insert(0, {role_key: draw(st.sampled_from(GPT_FROM if spec.fmt == "sharegpt" else ["assistant"])), content_key: draw(text)})
        return Spec(spec.fmt, record, Refused("must start with a user turn"))
    if case == "no_turn":
        kept = [m for m in messages if m[role_key] in ("system", "human", "user")]
        messages[:] = kept[: draw(st.integers(0, len(kept)))]
        return Spec(spec.fmt, record, Refused("no user/assistant turn to train on"))
    # message_shape: an entry that is not an object, or lacks its text
    at = draw(st.integers(0, len(messages) - 1))
    if draw(st.booleans()):
        messages[at] = draw(st.one_of(small_text, st.integers(), st.lists(small_text, max_size=2), st.none()))
    elif spec.fmt == "sharegpt":
        del messages[at][draw(st.sampled_from(["from", "value"]))]
    else:
        messages[at].pop("content", None)
        messages[at].pop("tool_calls", None)
    return Spec(spec.fmt, record, Refused("must be an object with"))


def paths_in(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths_in(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths_in(v, prefix + (i,))


@st.composite
def mutated(draw, specs):
    """A generated record with one random change: a field deleted or replaced by junk, or the record replaced."""
    spec = draw(specs)
    record = json.loads(json.dumps(spec.record))
    paths = list(paths_in(record))
    at = draw(st.sampled_from(paths))
    how = draw(st.sampled_from(["replace", "replace", "delete"]))
    if not at:
        return Spec(spec.fmt, draw(any_junk), None, True)
    parent = record
    for key in at[:-1]:
        parent = parent[key]
    if how == "delete":
        del parent[at[-1]]
    else:
        parent[at[-1]] = draw(any_junk)
    return Spec(spec.fmt, record, None, True)


def conversation_of(spec: Spec, default_system: str | None) -> Conversation:
    conv: Conversation = spec.expected
    return Conversation(conv.turns, conv.system if conv.system is not None else default_system, conv.tools)


def check_sft_record(tok: Tok, path: str, spec: Spec, record: Record, fmt: str):
    """One record as prepare() reads it: its conversation renders exactly, or it is a DataError for its line."""
    note(f"record {record.line}: {spec.fmt} {json.dumps(spec.record, ensure_ascii=False)[:300]}")
    try:
        if fmt == "auto":
            fmt = detect_format(record)
        check_format(record, fmt)
        conv = to_conversation(record, fmt)
    except DataError as e:
        assert spec.junk or isinstance(spec.expected, Refused), f"a well-formed {spec.fmt} record was refused: {e}"
        assert_names_line(e, path, [record.line])
        if isinstance(spec.expected, Refused):
            assert spec.expected.fragment in str(e), str(e)
        event("refused" if isinstance(spec.expected, Refused) else "junk refused")
        return
    assert not isinstance(spec.expected, Refused), f"accepted a record that must be refused ({spec.expected.fragment})"
    if not spec.junk:
        assert fmt == spec.fmt
        assert conv == spec.expected
    event("junk accepted" if spec.junk else "well-formed")
    samples, stats = tok.tokenize([conv], 10**6)
    if any(t.train for t in conv.turns):
        check_sample(tok, conv, samples[0])
        assert stats.kept == 1 and stats.trained_tokens == sum(label != IGNORE for label in samples[0].labels)
    else:
        assert samples == [None] and stats.dropped_untrained == 1


junk_spec = any_junk.map(lambda j: Spec("?", j, None, True))


@pytest.mark.parametrize("fmt", list(SFT_SPECS))
@fuzz(30)
@given(data=st.data())
def test_sft_records_render_exactly_or_name_their_line(workdir, ernie_tok, fmt, data):
    """Well-formed records (their meaning known), records with one field deleted or replaced by junk, and junk."""
    spec_ = SFT_SPECS[fmt]
    specs = data.draw(st.lists(st.one_of(spec_, spec_, mutated(spec_), junk_spec), min_size=1, max_size=4), label="records")
    text_, lines = jsonl_text([s.record for s in specs], data.draw)
    path = write_file(workdir, ".jsonl", text_)
    records = read_records(path)
    assert [r.line for r in records] == lines
    for spec, record in zip(specs, records):
        check_sft_record(ernie_tok, path, spec, record, data.draw(st.sampled_from(["auto", spec.fmt] if spec.fmt != "?" else ["auto"])))


@pytest.mark.parametrize("case", SFT_BREAKS)
@fuzz(8)
@given(data=st.data())
def test_sft_records_broken_in_known_ways_are_refused_with_their_line(workdir, ernie_tok, case, data):
    specs = data.draw(st.lists(st.one_of(refused_sft(case), refused_sft(case), sft_spec), min_size=1, max_size=3), label="records")
    text_, lines = jsonl_text([s.record for s in specs], data.draw)
    path = write_file(workdir, ".jsonl", text_)
    for spec, record in zip(specs, read_records(path)):
        check_sft_record(ernie_tok, path, spec, record, data.draw(st.sampled_from(["auto", spec.fmt])))


@pytest.mark.parametrize("fmt", FORMATS)  # every format a recipe can name (trl included) runs every time
@fuzz(10)
@given(
    data=st.data(),
    specs=st.lists(st.one_of(sft_spec, sft_spec, sft_spec, refused_sft(), mutated(sft_spec)), min_size=1, max_size=4),
    packing=st.booleans(),
    default_system=st.one_of(st.none(), small_text),
    as_array=st.booleans(),
)
@example(
    data=None, specs=[Spec("erniekit", {"src": "q", "tgt": "a"}, Conversation([Turn("q", "a")]))],
    packing=True, default_system=None, as_array=False,
).via("format: trl in an SFT recipe was a KeyError")
@example(
    data=None, specs=[Spec("sharegpt", {"conversations": [{"from": ["human"], "value": "q"}]}, Refused("unknown role"))],
    packing=True, default_system=None, as_array=False,
).via("an unhashable 'from' was a TypeError")
@example(
    data=None, specs=[Spec("messages", {"messages": [{"role": {"r": 1}, "content": "q"}]}, Refused("unknown role"))],
    packing=False, default_system=None, as_array=True,
).via("an unhashable 'role' was a TypeError")
def test_prepare_sft_file(workdir, ernie_tok, fmt, data, specs, packing, default_system, as_array):
    """A whole file through prepare(): the samples are the records' conversations rendered, or a DataError that
    names the first record prepare cannot read."""
    tok = ernie_tok
    if as_array:
        path = write_file(workdir, ".json", json.dumps([s.record for s in specs], indent=1, ensure_ascii=False))
    else:
        path = write_file(workdir, ".jsonl", jsonl_text([s.record for s in specs], data.draw if data else None)[0])
    records = read_records(path)
    lines = [r.line for r in records]
    section = DataSection(train=[{"path": path, "format": fmt}], max_length=10**6, packing=packing, system=default_system)
    used = fmt
    if fmt == "auto":
        try:
            used = detect_format(records[0])
        except DataError:
            used = None
    # where prepare() must stop: the first junk record (it may turn out readable) or record of another format
    first_bad = next((i for i, s in enumerate(specs) if s.junk or isinstance(s.expected, Refused) or s.fmt != used or used == "trl"), None)
    try:
        prepared = prepare(section, tok.tokenizer, log=lambda *a: None)
    except DataError as e:
        note(str(e))
        if e.line is None:  # a file-level error: nothing trainable at all
            assert "no trainable samples" in str(e), str(e)
            if first_bad is None:
                assert not any(t.train for s in specs for t in s.expected.turns)
            return
        assert first_bad is not None, f"prepare refused well-formed records: {e}"
        assert str(e).startswith(f"{path}:{e.line}: ")
        if specs[first_bad].junk:  # readable junk lets prepare go on to a later record
            assert e.line >= lines[first_bad], str(e)
        else:
            assert e.line == lines[first_bad], str(e)
            bad = specs[first_bad]
            if isinstance(bad.expected, Refused) and bad.fmt == used:
                assert bad.expected.fragment in str(e), str(e)
        event("refused, naming the line")
        return
    assert first_bad is None or specs[first_bad].junk, "prepare accepted a record it cannot read"
    convs = [
        conversation_of(s, default_system) if not s.junk else to_conversation(r, used, default_system)
        for s, r in zip(specs, records)
    ]
    kept = [c for c in convs if any(t.train for t in c.turns)]
    samples = prepared.train.samples
    assert len(samples) == len(kept) == prepared.train.stats.kept
    event("prepared")
    for conv, sample in zip(kept, samples):
        check_sample(tok, conv, sample)
    check_rows(prepared.train.rows, samples, 10**6 if packing else None)


@st.composite
def flat_sft(draw, fmt: str):
    """Records a CSV or Parquet file can hold: alpaca, or single-turn erniekit with string fields."""
    if fmt == "alpaca":
        record = {"instruction": draw(text), "input": draw(st.one_of(st.none(), text)), "output": draw(text), "system": draw(st.one_of(st.none(), text))}
        user = f"{record['instruction']}\n{record['input']}" if record["input"] else record["instruction"]
        return Spec("alpaca", record, Conversation([Turn(user, record["output"])], record["system"] or None))
    record = {"src": draw(text), "tgt": draw(text), "system": draw(st.one_of(st.none(), text))}
    return Spec("erniekit", record, Conversation([Turn(record["src"], record["tgt"])], record["system"] or None))


@fuzz(30)
@given(data=st.data(), suffix=st.sampled_from([".csv", ".parquet", ".json", ".jsonl"]), fmt=st.sampled_from(["alpaca", "erniekit"]))
def test_prepare_flat_records_from_every_file_type(workdir, ernie_tok, data, suffix, fmt):
    specs = data.draw(st.lists(flat_sft(fmt), min_size=1, max_size=4))
    rows = [s.record for s in specs]
    if suffix == ".csv":
        out = io.StringIO(newline="")
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        path = write_file(workdir, suffix, out.getvalue())
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = str(workdir / f"f{next(_names)}.parquet")
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path = write_file(workdir, suffix, json.dumps(rows) if suffix == ".json" else "".join(json.dumps(r) + "\n" for r in rows))
    records = read_records(path)
    # CSV has no empty string: an empty cell is a missing value, so an empty required field is an error there
    required = ["instruction", "output"] if fmt == "alpaca" else ["src", "tgt"]
    bad = [r.line for r, s in zip(records, specs) if suffix == ".csv" and any(s.record[k] == "" for k in required)]
    section = DataSection(train=[{"path": path, "format": data.draw(st.sampled_from(["auto", fmt]))}], max_length=10**6)
    try:
        prepared = prepare(section, ernie_tok.tokenizer, log=lambda *a: None)
    except DataError as e:
        assert bad and e.line == bad[0] and str(e).startswith(f"{path}:{bad[0]}: "), str(e)
        return
    assert not bad
    assert len(prepared.train.samples) == len(specs)
    for spec, sample in zip(specs, prepared.train.samples):
        check_sample(ernie_tok, spec.expected, sample)


# ---------------------------------------------------------------------------------------------------------------
# 3. Preference record formats
# ---------------------------------------------------------------------------------------------------------------


def skip_reason(chosen: str, rejected: str) -> str | None:
    if not chosen.strip() or not rejected.strip():
        return "empty response"
    if chosen.strip() == rejected.strip():
        return "identical chosen and rejected"
    return None


@st.composite
def responses(draw):
    """(first, second) response: mostly two different texts, sometimes an empty or a (nearly) identical pair."""
    kind = draw(st.sampled_from(["distinct", "distinct", "distinct", "empty", "same", "padded"]))
    chosen = draw(nonempty)
    if kind == "distinct":
        return chosen, draw(nonempty.filter(lambda r: r.strip() != chosen.strip()))
    if kind == "empty":
        empty = draw(st.sampled_from(["", " ", "\n\t", "\u3000"]))
        return (chosen, empty) if draw(st.booleans()) else (empty, chosen)
    return chosen, chosen if kind == "same" else " " + chosen + "\n"


@st.composite
def erniekit_pref(draw):
    history = draw(st.lists(st.tuples(text, text), max_size=2))
    prompt = draw(text)
    a, b = draw(responses())
    sort = draw(st.one_of(
        st.tuples(st.integers(-5, 5), st.integers(-5, 5)).filter(lambda t: t[0] != t[1]),
        st.tuples(st.floats(-1e9, 1e9), st.floats(-1e9, 1e9)).filter(lambda t: t[0] != t[1]),
        st.sampled_from([(1, 1), (0.5, 0.5), (1, 0), (0, 1), (2, 1.5)]),
    ))
    record: dict = {"src": [q for q, _ in history] + [prompt]}
    if history or draw(st.booleans()):
        record["tgt"] = [r for _, r in history]
    if not history and draw(st.booleans()):
        record["src"] = prompt
    record["response"] = [[a], [b]] if draw(st.booleans()) else [a, b]
    record["sort"] = list(sort)
    system = draw(st.one_of(st.none(), st.just(""), text))
    if system is not None:
        record["system"] = system
    if sort[0] == sort[1]:
        return Spec("erniekit", record, "tied sort")
    chosen, rejected = (a, b) if sort[0] > sort[1] else (b, a)
    pref = Preference([Turn(q, r, False) for q, r in history], prompt, chosen, rejected, system or None)
    return Spec("erniekit", record, skip_reason(chosen, rejected) or pref)


def tools_system(system: str | None, schemas: list) -> str | None:
    if not schemas:
        return system
    tools = "Tools: " + json.dumps(schemas, ensure_ascii=False)
    return f"{system}\n\n{tools}" if system else tools


@st.composite
def sharegpt_pref(draw):
    record_system = draw(st.one_of(st.none(), st.just(""), text))
    system = record_system or None
    conversation = []
    if draw(st.booleans()):
        s = draw(text)
        conversation.append({"from": "system", "value": s})
        system = s if system is None else f"{system}\n{s}"
    history = []
    for _ in range(draw(st.integers(0, 2))):
        q, a = draw(text), draw(text)
        conversation += [{"from": draw(st.sampled_from(USER_FROM)), "value": q}, {"from": draw(st.sampled_from(GPT_FROM)), "value": a}]
        history.append(Turn(q, a, False))
    prompts = draw(st.lists(text, min_size=1, max_size=2))
    conversation += [{"from": "human", "value": p} for p in prompts]
    a, b = draw(responses())

    def response(s):
        return s if draw(st.booleans()) else {"from": draw(st.sampled_from(GPT_FROM)), "value": s}

    record: dict = {"conversations": conversation, "chosen": response(a), "rejected": response(b)}
    if record_system is not None:
        record["system"] = record_system
    raw_tools, schemas = draw(tools_field())
    if raw_tools is not None:
        record["tools"] = raw_tools
    pref = Preference(history, "\n".join(prompts), a, b, system)
    return Spec("sharegpt", record, skip_reason(a, b) or pref, tools=schemas)


@st.composite
def trl_pref(draw):
    a, b = draw(responses())
    system = draw(st.one_of(st.none(), st.just(""), text))
    if draw(st.booleans()):
        prompt = draw(text)
        record: dict = {"prompt": prompt, "chosen": a, "rejected": b}
        history: list[Turn] = []
        merged_system = system or None
    else:
        messages, history, merged_system = [], [], system or None
        if draw(st.booleans()):
            s = draw(text)
            messages.append({"role": "system", "content": s})
            merged_system = s if merged_system is None else f"{merged_system}\n{s}"
        for _ in range(draw(st.integers(0, 2))):
            q, r = draw(text), draw(text)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": r}]
            history.append(Turn(q, r, False))
        prompt = draw(text)
        messages.append({"role": "user", "content": prompt})

        def response(s):
            return s if draw(st.booleans()) else [{"role": "assistant", "content": s}]

        record = {"prompt": messages, "chosen": response(a), "rejected": response(b)}
    if system is not None:
        record["system"] = system
    raw_tools, schemas = draw(tools_field())
    if raw_tools is not None:
        record["tools"] = raw_tools
    pref = Preference(history, prompt, a, b, merged_system)
    return Spec("trl", record, skip_reason(a, b) or pref, tools=schemas)


@st.composite
def alpaca_pref(draw):
    a, b = draw(responses())
    if draw(st.booleans()):
        prompt = draw(text)
        record: dict = {"question": prompt}
    else:
        instruction, extra = draw(text), draw(st.one_of(st.none(), st.just(""), text))
        record = {"instruction": instruction, "input": extra}
        prompt = f"{instruction}\n{extra}" if extra else instruction
    record.update(chosen=a, rejected=b)
    history = draw(maybe(st.lists(st.tuples(text, text).map(list), max_size=2)))
    if history is not None:
        record["history"] = history
    system = draw(st.one_of(st.none(), st.just(""), text))
    if system is not None:
        record["system"] = system
    pref = Preference([Turn(q, r, False) for q, r in history or []], prompt, a, b, system or None)
    return Spec("alpaca", record, skip_reason(a, b) or pref)


PREF_SPECS = {"erniekit": erniekit_pref(), "sharegpt": sharegpt_pref(), "trl": trl_pref(), "alpaca": alpaca_pref()}
pref_spec = st.one_of(*PREF_SPECS.values())


PREF_BREAKS = ["sort", "response", "tgt", "response_role", "prompt_order", "trl_prompt", "trl_response", "missing", "alpaca_types"]


@st.composite
def refused_pref(draw, case: str | None = None):
    """A well-formed preference record broken in one known way, with the message the DataError must hold."""
    case = case or draw(st.sampled_from(PREF_BREAKS))
    if case in ("sort", "response", "tgt"):
        spec = draw(erniekit_pref())
        record = _copy(spec.record)
        if case == "sort":
            record["sort"] = draw(st.sampled_from([[math.nan, 1], [1, math.nan], [math.nan, math.nan], [1], [1, 2, 3], ["1", 2], [True, 0], "12", None]))
            return Spec("erniekit", record, Refused("sort"))
        if case == "response":
            record["response"] = draw(st.sampled_from([[["a"]], [["a"], ["b"], ["c"]], "ab", [["a", "b"], ["c"]], [1, "b"], [[1], ["b"]], {"a": 1}]))
            return Spec("erniekit", record, Refused("response"))
        src = record["src"] if isinstance(record["src"], list) else [record["src"]]
        record["tgt"] = draw(st.lists(text, min_size=len(src), max_size=len(src) + 1))
        return Spec("erniekit", record, Refused("'src' has"))
    if case == "response_role":
        spec = draw(sharegpt_pref())
        record = _copy(spec.record)
        key = draw(st.sampled_from(["chosen", "rejected"]))
        bad = draw(st.one_of(
            st.sampled_from(["human", "observation", "system", "user", "tool"]).map(lambda r: ({"from": r, "value": "x"}, "must come from the assistant")),
            st.sampled_from([{"from": "gpt"}, 5, ["x"], True]).map(lambda v: (v, "must be an object with 'from' and 'value'")),
        ))
        record[key] = bad[0]
        return Spec("sharegpt", record, Refused(bad[1]))
    if case == "prompt_order":
        spec = draw(sharegpt_pref())
        record = _copy(spec.record)
        how = draw(st.sampled_from(["end", "start", "none"]))
        if how == "end":
            record["conversations"].append({"from": "gpt", "value": draw(text)})
            return Spec("sharegpt", record, Refused("must end with a user message"))
        if how == "start":
            record["conversations"].insert(0, {"from": "gpt", "value": draw(text)})
            return Spec("sharegpt", record, Refused("must start with a user message"))
        record["conversations"] = [m for m in record["conversations"] if m["from"] == "system"]
        return Spec("sharegpt", record, Refused("has no user message"))
    if case == "trl_prompt":
        spec = draw(trl_pref())
        record = _copy(spec.record)
        record["prompt"] = draw(st.one_of(st.integers(), st.booleans(), st.dictionaries(small_text, small_text, max_size=1)))
        return Spec("trl", record, Refused("field 'prompt' must be a string or a list"))
    if case == "trl_response":
        spec = draw(trl_pref())
        record = _copy(spec.record)
        key = draw(st.sampled_from(["chosen", "rejected"]))
        bad = draw(st.one_of(
            st.sampled_from([[], [{"role": "user", "content": "x"}], [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]]).map(
                lambda v: (v, "exactly one assistant message")
            ),
            st.one_of(st.integers(), st.booleans(), st.dictionaries(small_text, small_text, max_size=1)).map(lambda v: (v, "must be a string or a list")),
        ))
        record[key] = bad[0]
        return Spec("trl", record, Refused(bad[1]))
    if case == "missing":
        spec = draw(st.one_of(sharegpt_pref(), trl_pref(), alpaca_pref()))
        record = _copy(spec.record)
        if draw(st.booleans()):
            del record["rejected"]
        else:
            record["rejected"] = None
        return Spec(spec.fmt, record, Refused("'rejected'"))
    spec = draw(alpaca_pref())
    record = _copy(spec.record)
    key = draw(st.sampled_from(["chosen", "rejected", "question" if "question" in record else "instruction"]))
    record[key] = draw(non_str | st.none())
    return Spec("alpaca", record, Refused(f"field '{key}' must be a string"))


def final_pref(spec: Spec, default_system: str | None) -> Preference:
    """The record's preference after the recipe's default system; the tools follow the system prompt."""
    p: Preference = spec.expected
    system = p.system if p.system is not None else default_system
    return Preference(p.history, p.prompt, p.chosen, p.rejected, tools_system(system, spec.tools))

_pref_regressions = [  # (record, the message its DataError must hold, what went wrong before the fix)
    ({"src": ["q"], "response": [["a"], ["b"]], "sort": [math.nan, 1]}, "sort", "a NaN sort silently chose a side"),
    ({"src": ["q"], "response": [["a"], ["b"]], "sort": [math.nan, math.nan]}, "sort", "two NaN sorts were neither a tie nor an error"),
    (
        {"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": ["gpt"], "value": "a"}, "rejected": "b"},
        "must come from the assistant", "an unhashable 'from' was a TypeError",
    ),
    ({"prompt": [{"role": ["user"], "content": "q"}], "chosen": "a", "rejected": "b"}, "unknown role", "an unhashable 'role' was a TypeError"),
]


def _pref_regression(i: int):
    record, fragment, _ = _pref_regressions[i]
    return [Spec(detect_preference_format(Record(record, "-", 1)), record, Refused(fragment))]


def check_pref_record(path: str, spec: Spec, record: Record, fmt: str):
    """One preference record as prepare_pairs() reads it: exactly its pair, its skip reason, or a DataError for its line."""
    note(f"record {record.line}: {spec.fmt} {json.dumps(spec.record, ensure_ascii=False)[:300]}")
    try:
        if fmt == "auto":
            fmt = detect_preference_format(record)
        pref = to_preference(record, fmt)
    except Skip as why:
        assert spec.junk or spec.expected == str(why), (spec.expected, str(why))
        event(f"skipped: {why}")
        return
    except DataError as e:
        assert spec.junk or isinstance(spec.expected, Refused), f"a well-formed {spec.fmt} record was refused: {e}"
        assert_names_line(e, path, [record.line])
        if isinstance(spec.expected, Refused):
            assert spec.expected.fragment in str(e), str(e)
        event("refused" if isinstance(spec.expected, Refused) else "junk refused")
        return
    assert not isinstance(spec.expected, Refused), f"accepted a record that must be refused ({spec.expected.fragment})"
    if not spec.junk:
        assert fmt == spec.fmt and pref == final_pref(spec, None)
    event("junk accepted" if spec.junk else "well-formed")
    assert isinstance(pref.prompt, str) and pref.chosen.strip() and pref.chosen.strip() != pref.rejected.strip()
    assert all(isinstance(t.user, str) and isinstance(t.assistant, str) and not t.train for t in pref.history)


@pytest.mark.parametrize("fmt", list(PREF_SPECS))
@fuzz(25)
@given(data=st.data())
def test_preference_records_parse_exactly_or_name_their_line(workdir, fmt, data):
    spec_ = PREF_SPECS[fmt]
    specs = data.draw(st.lists(st.one_of(spec_, spec_, mutated(spec_), junk_spec), min_size=1, max_size=4), label="records")
    text_, lines = jsonl_text([s.record for s in specs], data.draw)
    path = write_file(workdir, ".jsonl", text_)
    for spec, record in zip(specs, read_records(path)):
        check_pref_record(path, spec, record, data.draw(st.sampled_from(["auto", spec.fmt] if spec.fmt != "?" else ["auto"])))


@pytest.mark.parametrize("case", PREF_BREAKS)
@fuzz(8)
@given(data=st.data())
@example(data=None).via("regressions: " + "; ".join(why for _, _, why in _pref_regressions))
def test_preference_records_broken_in_known_ways_are_refused_with_their_line(workdir, case, data):
    if data is None:  # the inputs fuzzing found, before they were fixed
        specs = [_pref_regression(i)[0] for i in range(len(_pref_regressions))]
        path = write_file(workdir, ".jsonl", jsonl_text([s.record for s in specs])[0])
        for spec, record in zip(specs, read_records(path)):
            check_pref_record(path, spec, record, "auto")
        return
    specs = data.draw(st.lists(st.one_of(refused_pref(case), refused_pref(case), pref_spec), min_size=1, max_size=3), label="records")
    text_, lines = jsonl_text([s.record for s in specs], data.draw)
    path = write_file(workdir, ".jsonl", text_)
    for spec, record in zip(specs, read_records(path)):
        check_pref_record(path, spec, record, data.draw(st.sampled_from(["auto", spec.fmt])))


@pytest.mark.parametrize("fmt", list(PREF_SPECS))
@fuzz(12)
@given(data=st.data(), packing=st.booleans(), default_system=st.one_of(st.none(), small_text))
def test_prepare_preference_file(workdir, ernie_tok, fmt, data, packing, default_system):
    """prepare_pairs(): each pair is prompt + chosen and prompt + rejected rendered, trained on the response only;
    skipped records are counted by reason; rows hold whole pairs."""
    tok = ernie_tok
    specs = data.draw(st.lists(PREF_SPECS[fmt], min_size=2, max_size=4), label="records")
    text_, _ = jsonl_text([s.record for s in specs], data.draw)
    path = write_file(workdir, ".jsonl", text_)
    section = DataSection(train=[{"path": path, "format": data.draw(st.sampled_from(["auto", fmt]))}], max_length=10**6, packing=packing, system=default_system)
    skipped = Counter(s.expected for s in specs if isinstance(s.expected, str))
    expected = []
    for s in specs:
        if isinstance(s.expected, Preference):
            p = final_pref(s, default_system)
            convs = [Conversation(p.history + [Turn(p.prompt, response)], p.system) for response in (p.chosen, p.rejected)]
            if render(tok, convs[0]).ids == render(tok, convs[1]).ids:  # e.g. "a b" and "a▁b" are one text to ERNIE
                skipped["identical after truncation"] += 1
                continue
            expected.append(convs)
    try:
        prepared = prepare_pairs(section, tok.tokenizer, log=lambda *a: None)
    except DataError as e:
        assert not expected and "no trainable preference pairs" in str(e), str(e)
        return
    assert prepared.train.stats.skipped == skipped
    pairs = prepared.train.pairs
    event(f"pairs kept: {min(len(pairs), 2)}{'+' if len(pairs) > 2 else ''}")
    assert len(pairs) == len(expected)
    for (chosen_conv, rejected_conv), pair in zip(expected, pairs):
        check_sample(tok, chosen_conv, pair.chosen)
        check_sample(tok, rejected_conv, pair.rejected)
        first = render(tok, chosen_conv).spans[-1][0]
        assert pair.chosen.input_ids[:first] == pair.rejected.input_ids[:first]  # one shared prompt
    check_pair_rows(prepared.train.rows, pairs, 10**6, packing)


# ---------------------------------------------------------------------------------------------------------------
# 4. Renderer and label masker on arbitrary conversations, with overlong handling
# ---------------------------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), small_text),
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(small_text, kids, max_size=3)),
    max_leaves=6,
)
tool_call_lists = st.lists(st.builds(lambda n, a: {"type": "function", "function": {"name": n, "arguments": a}}, tool_names, json_values), max_size=2)
turns = st.builds(
    Turn,
    user=text,
    assistant=text,
    train=st.booleans(),
    tool_calls=tool_call_lists,
    tool_result=st.booleans(),
)
conversations = st.builds(
    Conversation,
    turns=st.lists(turns, min_size=1, max_size=4),
    system=st.one_of(st.none(), st.just(""), text),
    tools=st.lists(st.dictionaries(small_text, json_values, max_size=2), max_size=2),
)


# Models' own templates (the tests that pin each one down live beside them): plain ChatML; the Thinking style (text
# trimmed, an empty <think> block opening each answer); ERNIE-4.5-21B-A3B-Thinking's own, as released (system setting,
# tool list, tool results as JSON strings in <tool_output>, calls in <tool_call>, the generation prompt opening <think>,
# earlier answers' <think> blocks dropped); ChatML with tools after Qwen2.5's (each tool as JSON, a
# call's name written as is, its arguments as JSON or as written); and one that drops the reasoning of answered turns
# once a later turn follows, so that `ModelTemplate.expand` makes each trained turn its own sample.
OWN_TEMPLATES = {
    "chatml": CHATML, "thinking-style": THINKING_STYLE, "thinking": THINKING_TEMPLATE, "chatml-tools": CHATML_TOOLS,
    "drops-reasoning": DROPS_REASONING,
}


@pytest.fixture(scope="module", params=list(OWN_TEMPLATES))
def own_template_tokenizer(request, ernie_tokenizer):
    """The real tokenizer with ChatML's control tokens (the Thinking model's) and a model's own template."""
    import copy

    tokenizer = copy.deepcopy(ernie_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": CONTROL})
    tokenizer.chat_template = OWN_TEMPLATES[request.param]
    return request.param, tokenizer


reasoned = st.one_of(text, st.builds(lambda r, a: f"<think>{r}</think>{a}", small_text, text))  # answers with reasoning


def _schema(name: str, description: str, parameters: dict, required: bool, wrapped: bool) -> dict:
    function = {"name": name, "description": description,
                "parameters": {"type": "object", "properties": parameters, "required": list(parameters) if required else []}}
    return {"type": "function", "function": function} if wrapped else function


# tool lists as templates read them: function schemas (name, description, parameters with descriptions and enum
# values, the required list; wrapped in {"type": "function"} or bare) and junk dicts, any string spelling control tokens
own_template_tools = st.lists(
    st.one_of(
        st.builds(
            _schema, tool_names, text,
            st.dictionaries(small_text, st.fixed_dictionaries({"type": st.just("string"), "description": small_text},
                                                              optional={"enum": st.lists(small_text, max_size=2)}), max_size=2),
            st.booleans(), st.booleans(),
        ),
        st.dictionaries(small_text, json_values, max_size=2),
    ),
    max_size=2,
)
own_template_conversations = st.builds(
    Conversation,
    turns=st.lists(st.builds(Turn, user=text, assistant=reasoned, train=st.booleans(), tool_calls=tool_call_lists,
                             tool_result=st.booleans()), min_size=1, max_size=4),
    system=st.one_of(st.none(), st.just(""), text),
    tools=own_template_tools,
)


def _strings(value) -> list[str]:
    """Every string of a JSON value, dict keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(k) + _strings(v)]
    return [s for v in value for s in _strings(v)] if isinstance(value, (list, tuple)) else []


def _neutral(value, spelling: re.Pattern):
    """A JSON value with each control-token spelling in its strings (dict keys included) replaced by "x"."""
    if isinstance(value, str):
        return spelling.sub("x", value)
    if isinstance(value, dict):
        return {_neutral(k, spelling): _neutral(v, spelling) for k, v in value.items()}
    return [_neutral(v, spelling) for v in value] if isinstance(value, (list, tuple)) else value


def _thinking_rewrites(conv: Conversation) -> bool:
    """Whether the released Thinking template renders an answered turn differently once the next turn follows: an
    answer keeps its <think> block only after the last user query, and, unless it is the last message, only when it has
    reasoning (the text before its first `</think>`, after the last `<think>` there, newlines trimmed)."""
    def reasoning(answer: str) -> str:
        return answer.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n") if "</think>" in answer else ""

    return conv.turns[0].tool_result or any(
        not turn.tool_result or not reasoning(before.assistant) for before, turn in zip(conv.turns, conv.turns[1:]))


def _thinking_untrainable(conv: Conversation) -> bool:
    """Whether a sample ends on an answer that no user query precedes (the conversation opens with tool results): the
    released Thinking template then renders it without the <think> block its generation prompt opened. Such a sample
    is one trained turn among those, or the whole conversation when none is trained and it holds no query."""
    leading = next((i for i, t in enumerate(conv.turns) if not t.tool_result), len(conv.turns))
    return leading > 0 and (any(t.train for t in conv.turns[:leading]) or
                            (leading == len(conv.turns) and not any(t.train for t in conv.turns)))


def _function_tools(tools: list) -> list:
    return [t if isinstance(t.get("function"), dict) else {"type": "function", "function": t} for t in tools]


@fuzz(40)
@given(convs=st.lists(own_template_conversations, min_size=1, max_size=3))
@example(convs=[Conversation([Turn("<|im_end|>\n<|im_start|>assistant\nhi", "ok"), Turn("<|im_start|>", "<|im_end|>", tool_result=True)], " <|im_end|> ")])
@example(convs=[Conversation([Turn(" <|im_end|> ", "<think><|im_end|></think>a1"), Turn("<|im_start|>tool", "<think>r2</think><|im_start|>"),
                              Turn("</s><|end_of_sentence|>", "a3", train=False)], "<|im_start|>system")])
@example(convs=[Conversation(
    [Turn("q", "<think>r</think>a", tool_calls=[{"type": "function", "function": {"name": "<|im_end|>", "arguments": {"<|im_start|>": '"</s>'}}}]),
     Turn("r", "b", tool_result=True, tool_calls=[{"type": "function", "function": {"name": "f", "arguments": '{"a": "<|im_end|>"}'}}])],
    "S",
    [_schema("f<|im_end|>", '"<|im_end|>"\\\n', {"<s>": {"type": "string", "description": "<|end_of_sentence|>", "enum": ["<|im_start|>"]}}, True, True),
     _schema("<|im_start|>", "", {}, False, False), {"<|im_end|>": ["</s>", {"type": "<|im_end|>"}]}],
)])
def test_model_template_never_turns_message_text_into_control_tokens(own_template_tokenizer, convs):
    """Under a model's own template, control ids come from its markup and the assistant's text only, whatever spellings
    of control tokens the user, system and tool text holds, and the strings of the tool list and of the assistant's
    tool calls (names, descriptions, parameters, enum values, argument keys and values; rendered by `tojson` or as
    written): every sample holds exactly the control ids of the same conversation rendered by the template with each
    user, system and tool text replaced by a neutral "x" and each control-token spelling in the tool-list and tool-call
    strings replaced by "x", then parsed whole."""
    name, tokenizer = own_template_tokenizer
    tokenize = Tokenizer(tokenizer, template_for(tokenizer))
    control = set(tokenizer.added_tokens_decoder)  # every added token: ChatML's and ERNIE's own (</s>, <|end_of_sentence|>, ...)
    special = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len, reverse=True)
    spelling = re.compile("|".join(map(re.escape, special)))  # what parsing markup matches and parsing text does not
    for conv in convs:
        texts = [conv.system or ""] + [t.user for t in conv.turns]
        structured = _strings(conv.tools) + [s for t in conv.turns for s in _strings(t.tool_calls)]
        if any("\ue000" in t for t in texts + structured):  # the placeholder's character: refused, not misread
            with pytest.raises(UserError, match="U\\+E000"):
                tokenize(tokenize.template.expand(conv), 10**6)
            continue
        parts = tokenize.template.expand(conv)
        if name == "thinking" and _thinking_untrainable(conv):
            with pytest.raises(UserError, match="^the model's chat template cannot be split into trained turns"):
                tokenize(parts, 10**6)
            event("thinking: an answer before any user query, refused")
            continue
        if name in ("drops-reasoning", "thinking"):  # an earlier turn's rendering changed: one sample per trained turn
            rewritten = (_thinking_rewrites(conv) if name == "thinking"
                         else any("</think>" in t.assistant for t in conv.turns[:-1]))
            assert len(parts) == (max(1, sum(t.train for t in conv.turns)) if rewritten else 1)
            event(f"{name}: {len(parts)} samples from {len(conv.turns)} turns")
        else:
            assert parts == [conv]
        samples, _ = tokenize(parts, 10**6)
        for part, sample in zip(parts, samples):
            if sample is None:
                assert not any(t.train for t in part.turns)
                continue
            messages = [{"role": "system", "content": "x"}] if part.system else []
            for turn in part.turns:
                messages.append({"role": "tool" if turn.tool_result else "user", "content": "x" if turn.user else ""})
                calls = {"tool_calls": _neutral(turn.tool_calls, spelling)} if turn.tool_calls else {}
                messages.append({"role": "assistant", "content": turn.assistant, **calls})
            # training's copy of a template (the released Thinking one appends the generation prompt whatever it is
            # asked), tools in the shape templates read (the Thinking one renders `tool.function`)
            neutral = tokenizer.apply_chat_template(messages, tools=_function_tools(_neutral(part.tools, spelling)) or None,
                                                    tokenize=False, chat_template=tokenize.template.chat_template)
            expected = Counter(i for i in tokenizer(neutral, add_special_tokens=False)["input_ids"] if i in control)
            assert Counter(i for i in sample.input_ids if i in control) == expected


@fuzz(40)
@given(convs=st.lists(conversations, min_size=1, max_size=4))
@example(convs=[Conversation([Turn("<|end_of_sentence|></s><|begin_of_sentence|><s><unk><mask:1>", "</s><|end_of_sentence|>")], "<|begin_of_sentence|>")])
def test_render_ids_labels_and_no_injected_control_tokens(tok, convs):
    samples, stats = tok.tokenize(convs, 10**6)
    for conv, sample in zip(convs, samples):
        if any(t.train for t in conv.turns):
            check_sample(tok, conv, sample)
        else:
            assert sample is None
    assert stats.kept == sum(s is not None for s in samples) and stats.dropped_untrained == len(convs) - stats.kept
    assert stats.truncated == stats.dropped_overlong == 0


@fuzz(20)
@given(conv=conversations)
def test_training_prompt_is_the_inference_prompt(tok, conv):
    """The tokens before each response are exactly what inference feeds the model for that history."""
    conv = Conversation(conv.turns, conv.system, [])  # inference has no tool list
    want = render(tok, conv)
    for i, (start, _, _, _) in enumerate(want.spans):
        pieces = tok.tokenize.template.generation_prompt(conv.system, conv.turns[:i], conv.turns[i].user)
        encoded = iter(tok.tokenize.encode([p.text for p in pieces if p.text is not None]))
        ids = [t for p in pieces for t in (next(encoded) if p.text is not None else p.ids)]
        assert ids == want.ids[:start]


@fuzz(45)
@given(data=st.data(), convs=st.lists(conversations, min_size=1, max_size=4), overlong=st.sampled_from(["truncate", "drop"]))
def test_overlong_truncate_or_drop_and_pack(tok, data, convs, overlong):
    """Random max_length: kept samples fit, keep the most recent turns that fit (or cut the last response, ending on
    a trained token), drops are counted; then the samples pack and collate exactly."""
    full = [render(tok, c) for c in convs]
    near = st.builds(lambda f, x: max(1, int(len(f.ids) * x)), st.sampled_from(full), st.floats(0.2, 1.05))
    max_length = data.draw(st.one_of(near, near, st.integers(1, max(len(f.ids) for f in full) + 2)), label="max_length")
    samples, stats = tok.tokenize(convs, max_length, overlong)
    counts = Counter()
    for conv, want, sample in zip(convs, full, samples):
        trained = any(t.train for t in conv.turns)
        if len(want.ids) <= max_length:
            reason = None if trained else "untrained"
            if trained:
                assert not sample.truncated
                check_sample(tok, conv, sample)
        elif overlong == "drop":
            reason = "overlong"
        else:
            reason = expected_truncation(tok, conv, max_length, sample)
        event(f"{overlong}: {reason or ('kept whole' if sample is not None and not sample.truncated else 'truncated')}")
        if reason:
            assert sample is None, reason
            counts[reason] += 1
        else:
            assert sample is not None and len(sample) <= max_length
            check_labels(tok, sample)
            assert any(label != IGNORE for label in sample.labels)
    assert (stats.dropped_overlong, stats.dropped_untrained) == (counts["overlong"], counts["untrained"])
    kept = [s for s in samples if s is not None]
    assert stats.kept == len(kept) and stats.truncated == sum(s.truncated for s in kept)
    assert stats.lengths == [len(s) for s in kept]
    assert stats.trained_tokens == sum(label != IGNORE for s in kept for label in s.labels)
    if kept:
        rows = pack(kept, max_length)
        check_rows(rows, kept, max_length)
        check_collation(rows, max_length, data.draw(st.integers(1, len(rows))))


def expected_truncation(tok: Tok, conv: Conversation, max_length: int, sample: Sample | None) -> str | None:
    """Check a truncated sample against the rule; return the drop reason when it must be dropped."""
    for start in range(1, len(conv.turns)):
        tail = Conversation(conv.turns[start:], conv.system, conv.tools)
        want = render(tok, tail)
        if len(want.ids) <= max_length:  # the most recent turns that fit, re-rendered as a conversation of their own
            if not any(t.train for t in tail.turns):
                return "untrained"
            assert sample.truncated and sample.input_ids == want.ids and sample.labels == want.labels
            check_control_ids(tok, sample.input_ids, want.spans)
            event("truncate: kept the last turns that fit")
            return None
    last = render(tok, Conversation(conv.turns[-1:], conv.system, conv.tools))
    if last.prompt_length >= max_length:  # not even the last prompt fits
        return "overlong"
    if not conv.turns[-1].train:
        return "untrained"
    # the last turn alone, its response cut: ends on a trained response token, the end-of-turn cut off with it
    assert sample.truncated and len(sample) == max_length
    assert sample.input_ids == last.ids[:max_length] and sample.labels == last.labels[:max_length]
    assert sample.labels[-1] == sample.input_ids[-1] != IGNORE
    check_control_ids(tok, sample.input_ids, last.spans)
    event("truncate: cut the last response")
    return None


# ---------------------------------------------------------------------------------------------------------------
# 5. Packing (best-fit decreasing) and collation
# ---------------------------------------------------------------------------------------------------------------


def check_rows(rows, samples: list[Sample], max_length: int | None):
    """Every sample exactly once, whole; rows within capacity; no two rows that would fit in one (any-fit)."""
    seen = Counter()
    for row in rows:
        assert len(row.input_ids) == len(row.labels) == sum(row.seq_lengths)
        assert all(n > 0 for n in row.seq_lengths)
        if max_length is not None:
            assert len(row.input_ids) <= max_length
        start = 0
        for n in row.seq_lengths:
            seen[(tuple(row.input_ids[start : start + n]), tuple(row.labels[start : start + n]))] += 1
            start += n
    assert seen == Counter((tuple(s.input_ids), tuple(s.labels)) for s in samples)
    if max_length is not None:
        sizes = sorted(len(r.input_ids) for r in rows)
        assert len(sizes) < 2 or sizes[0] + sizes[1] > max_length


def check_collation(rows, max_length: int, batch: int):
    for i in range(0, len(rows), batch):
        group = [{"input_ids": r.input_ids, "labels": r.labels, "seq_lengths": r.seq_lengths} for r in rows[i : i + batch]]
        lengths = [n for r in group for n in r["seq_lengths"]]
        out = PackedCollator(max_length)(group)
        total = sum(lengths)
        assert out["input_ids"].shape == out["labels"].shape == out["position_ids"].shape == (1, total)
        assert out["input_ids"][0].tolist() == [t for r in group for t in r["input_ids"]]
        cu = out["cu_seq_lens_q"]
        assert cu.equal(out["cu_seq_lens_k"]) and cu.dtype.is_floating_point is False
        assert cu[0] == 0 and cu[-1] == total and (cu[1:] - cu[:-1]).tolist() == lengths
        assert out["max_length_q"] == out["max_length_k"] == max(lengths)
        assert out["position_ids"][0].tolist() == [p for n in lengths for p in range(n)]  # restart at each sample
        assert out["token_slots"] == len(group) * max_length
        labels = out["labels"][0].tolist()
        starts = set(cu[:-1].tolist())
        assert all(labels[s] == IGNORE for s in starts)  # no sample's first token is a target of the previous one
        keep, targets = labelled_positions(out["labels"])
        kept = keep[0].nonzero().flatten().tolist()
        assert all(p + 1 not in starts for p in kept)  # scored positions never predict across a boundary
        # the padded layout trains on exactly the same tokens
        padded = PaddedCollator(0)(group)
        flat = [[t for t in r["labels"]] for r in group]
        assert padded["attention_mask"].sum(1).tolist() == [len(f) for f in flat]
        pad_keep, pad_targets = labelled_positions(padded["labels"])
        assert sorted(pad_targets.tolist()) == sorted(targets.tolist())


@st.composite
def synthetic_samples(draw, max_length: int):
    """Any labels, the first token's included: packing must refuse a sample whose first token is trained."""
    n = draw(st.integers(1, max_length))
    ids = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    trained = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return Sample(ids, [t if k else IGNORE for t, k in zip(ids, trained)])


def refused_then_fixed(samples: list[Sample], *packers) -> list[Sample]:
    """If a sample's first token is trained, each packer refuses the list; the samples with it untrained."""
    if any(s.labels[0] != IGNORE for s in samples):
        for packer in packers:
            with pytest.raises(ValueError, match="first token is labelled"):
                packer(samples)
    return [Sample(s.input_ids, [IGNORE] + s.labels[1:]) for s in samples]


@fuzz(60)
@given(data=st.data(), max_length=st.integers(1, 64))
@example(data=None, max_length=8)
def test_packing_properties(data, max_length):
    if data is None:  # docs/data.md (Packing) example: A=5 B=3 C=2 D=4 into rows of 8
        samples = [Sample([1] * n, [IGNORE] * n) for n in (5, 3, 2, 4)]
        assert [r.seq_lengths for r in pack(samples, 8)] == [[5, 3], [4, 2]]
        return
    samples = data.draw(st.lists(synthetic_samples(max_length), max_size=30))
    samples = refused_then_fixed(samples, lambda s: pack(s, max_length), one_per_row)
    bins = best_fit_decreasing([len(s) for s in samples], max_length)
    assert sorted(i for b in bins for i in b) == list(range(len(samples)))
    assert bins == best_fit_decreasing([len(s) for s in samples], max_length)  # deterministic
    rows = pack(samples, max_length)
    check_rows(rows, samples, max_length)
    assert len(rows) >= math.ceil(sum(len(s) for s in samples) / max_length)
    check_rows(one_per_row(samples), samples, None)
    if rows:
        check_collation(rows, max_length, data.draw(st.integers(1, len(rows))))
    with pytest.raises(ValueError, match="more than the row capacity"):
        best_fit_decreasing([max_length + 1], max_length)


def check_pair_rows(rows, pairs: list[Pair], max_length: int, packing: bool):
    seen = Counter()
    for row in rows:
        assert len(row.input_ids) == len(row.labels) == sum(row.seq_lengths) <= 2 * max_length
        assert len(row.seq_lengths) % 2 == 0
        start, seqs = 0, []
        for n in row.seq_lengths:
            seqs.append((tuple(row.input_ids[start : start + n]), tuple(row.labels[start : start + n])))
            start += n
        for chosen, rejected in zip(seqs[0::2], seqs[1::2]):  # chosen right before its rejected, in one row
            seen[(chosen, rejected)] += 1
        if not packing:
            assert len(seqs) == 2
    assert seen == Counter(((tuple(p.chosen.input_ids), tuple(p.chosen.labels)), (tuple(p.rejected.input_ids), tuple(p.rejected.labels))) for p in pairs)


@fuzz(40)
@given(data=st.data(), max_length=st.integers(2, 40), packing=st.booleans())
def test_pair_packing_and_collation(data, max_length, packing):
    """Pairs stay whole; the packed and padded DPO collators score the same tokens, at the places logp_index says."""
    pairs = data.draw(st.lists(st.builds(Pair, synthetic_samples(max_length), synthetic_samples(max_length)), min_size=1, max_size=8))
    sides = [refused_then_fixed([getattr(p, side) for p in pairs]) for side in ("chosen", "rejected")]
    if any(s.labels[0] != IGNORE for p in pairs for s in (p.chosen, p.rejected)):
        with pytest.raises(ValueError, match="first token is labelled"):
            pack_pairs(pairs, max_length, packing)
    pairs = [Pair(c, r) for c, r in zip(*sides)]
    rows = pack_pairs(pairs, max_length, packing)
    check_pair_rows(rows, pairs, max_length, packing)
    batch = data.draw(st.integers(1, len(rows)))
    group = [{"input_ids": r.input_ids, "labels": r.labels, "seq_lengths": r.seq_lengths} for r in rows[:batch]]
    packed = PackedPairCollator(max_length)(group)
    padded = PaddedPairCollator(0)(group)
    width = packed["input_ids"].shape[1]
    assert packed["input_ids"].equal(padded["input_ids"]) and packed["attention_mask"].equal(padded["attention_mask"])
    assert packed["completion_mask"].equal(padded["completion_mask"])
    # the packed scores come out in packed order; logp_index must put each at its sequence's row and column
    keep, targets = labelled_positions(packed["packed_labels"])
    index = packed["logp_index"]
    assert len(index) == len(targets) == len(padded["logp_index"])
    rows_, cols = index // (width - 1), index % (width - 1)
    assert padded["pair_labels"][rows_, cols + 1].equal(targets)  # position col predicts token col + 1 of that sequence
    assert sorted(index.tolist()) == sorted(padded["logp_index"].tolist())
    starts = set(packed["cu_seq_lens_q"][:-1].tolist())
    assert all(p + 1 not in starts for p in keep[0].nonzero().flatten().tolist())
