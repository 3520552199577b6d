"""The tokenized-data cache and parallel tokenization: a cache hit or any number of processes gives exactly the
samples, rows, statistics and source reports of a fresh run in one process; any change to an input misses.

Every test points ERNIEKIT_CACHE at its own temporary folder and lowers the size threshold so small files are
cached.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict

import pytest

from erniekit_lite.data import cache, prepare as prepare_module
from erniekit_lite.data.prepare import prepare, prepare_pairs
from erniekit_lite.data.template import ErnieTemplate
from erniekit_lite.errors import UserError
from erniekit_lite.recipe import DataSection
from conftest import DATA_DIR, SHARED_HOW, missing

ALPACA = DATA_DIR / "llamafactory" / "alpaca_en_demo.json"


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("ERNIEKIT_CACHE", str(root))
    monkeypatch.setattr(cache, "MIN_BYTES", 0)
    return root / "data"


@pytest.fixture
def sft_files(tmp_path):
    """Two sources: alpaca records, and multi-turn ERNIEKit records that truncate, drop and mask at max_length 64."""
    if not ALPACA.is_file():
        missing(f"the shared data file {ALPACA}", SHARED_HOW)
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps(json.loads(ALPACA.read_text())[:40]))
    turns = tmp_path / "turns.jsonl"
    records = []
    for i in range(30):
        n = 1 + i % 4
        records.append({
            "system": "Be brief." if i % 3 else None,
            "src": [f"question {i}.{k} " + "why " * (i % 7) for k in range(n)],
            "tgt": [f"answer {i}.{k} " + "because " * (i % 5) for k in range(n)],
            "label": [0] * n if i % 11 == 5 else [1] * n,  # every 11th record trains nothing: dropped
        })
    turns.write_text("\n".join(json.dumps({k: v for k, v in r.items() if v is not None}) for r in records))
    return [str(alpaca), str(turns)]


@pytest.fixture
def dpo_file(tmp_path):
    """ERNIEKit preference records whose skips come in a fixed order: tied sorts, identical answers, long prompts."""
    records = []
    for i in range(40):
        answers = [f"yes {i} " * (2 + 3 * (i % 9)), f"no {i} " * (1 + i % 5)]
        sort = [1, 0] if i % 2 else [0, 1]
        if i % 13 == 4:
            sort = [1, 1]  # skipped while reading: tied sort
        if i % 17 == 8:
            answers = ["same", "same"]  # skipped while reading: identical
        prompt = "long prompt " * 40 if i % 10 == 7 else f"prompt {i}"  # skipped when tokenizing at max_length 64
        records.append({"src": [f"earlier {i}", prompt], "tgt": [f"reply {i}"], "response": [[answers[0]], [answers[1]]], "sort": sort})
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    return str(path)


def _sft(files, **settings) -> DataSection:
    return DataSection(train=[{"path": p} for p in files], **{"max_length": 64, **settings})


def _split_view(split) -> dict:
    return {
        "samples": [asdict(s) for s in split.samples],
        "rows": [asdict(r) for r in split.rows],
        "stats": asdict(split.stats),
        "sources": [asdict(r) for r in split.sources],
    }


def _pairs_view(split) -> dict:
    return {
        "pairs": [asdict(p) for p in split.pairs],
        "rows": [asdict(r) for r in split.rows],
        "stats": {**asdict(split.stats), "skipped": list(split.stats.skipped.items())},  # order reaches messages
        "sources": [asdict(r) for r in split.sources],
    }


class Log(list):
    def __call__(self, line):
        self.append(line)

    @property
    def hits(self) -> int:
        return sum("data cache:" in line and "reused" in line for line in self)


def _run(data, tokenizer, pairs=False):
    log = Log()
    prepared = (prepare_pairs if pairs else prepare)(data, tokenizer, log=log)
    view = _pairs_view if pairs else _split_view
    return {"train": view(prepared.train), "eval": view(prepared.eval) if prepared.eval else None}, log


# ---------------------------------------------------------------------------------------------------------------
# Hits give exactly what a fresh run gives
# ---------------------------------------------------------------------------------------------------------------


def test_sft_hit_is_identical_and_skips_tokenizing(ernie_tokenizer, sft_files, cache_root, monkeypatch):
    data = _sft(sft_files, eval_split=0.2)
    fresh, fresh_log = _run(data.model_copy(update={"cache": False}), ernie_tokenizer)
    assert not cache_root.exists()  # cache: false writes nothing
    assert fresh["train"]["stats"]["truncated"] and fresh["train"]["stats"]["dropped_untrained"]  # the data exercises both

    first, first_log = _run(data, ernie_tokenizer)
    assert first == fresh and first_log.hits == 0 and len(list(cache_root.glob("*.npz"))) == 1

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("a cache hit must not tokenize")

    monkeypatch.setattr(prepare_module.Tokenizer, "__call__", no_tokenizing)
    second, second_log = _run(data, ernie_tokenizer)
    assert second == fresh
    assert second_log.hits == 1
    # the lines a fresh read prints (format detection) are printed on a hit too
    assert [line for line in second_log if "data cache" not in line] == fresh_log


def test_dpo_hit_is_identical_including_skip_order(ernie_tokenizer, dpo_file, cache_root):
    data = DataSection(train=[dpo_file], max_length=64)
    fresh, _ = _run(data.model_copy(update={"cache": False}), ernie_tokenizer, pairs=True)
    skipped = [why for why, _ in fresh["train"]["stats"]["skipped"]]
    assert skipped == ["prompt longer than max_length", "tied sort", "identical chosen and rejected"]
    assert fresh["train"]["stats"]["truncated"]
    first, _ = _run(data, ernie_tokenizer, pairs=True)
    second, log = _run(data, ernie_tokenizer, pairs=True)
    assert first == fresh and second == fresh and log.hits == 1


def test_eval_sources_have_their_own_entry(ernie_tokenizer, sft_files, cache_root):
    data = DataSection(train=[sft_files[0]], eval=[sft_files[1]], max_length=64)
    first, _ = _run(data, ernie_tokenizer)
    second, log = _run(data, ernie_tokenizer)
    assert second == first and log.hits == 2 and len(list(cache_root.glob("*.npz"))) == 2


# ---------------------------------------------------------------------------------------------------------------
# Any change to an input misses
# ---------------------------------------------------------------------------------------------------------------


def _same_size_edit(path: str) -> None:
    text = open(path, encoding="utf-8").read()
    at = text.index("question 3.0")
    open(path, "w", encoding="utf-8").write(text[:at] + "QUESTION" + text[at + len("question") :])


@pytest.mark.parametrize(
    "change",
    [
        "file content (same size)",
        "max_length",
        "overlong",
        "system",
        "format",
        "max_samples",
        "tokenizer vocabulary",
        "chat template",
    ],
)
def test_changed_input_misses(ernie_tokenizer, sft_files, cache_root, change):
    import copy

    data, tokenizer = _sft(sft_files), ernie_tokenizer
    _run(data, tokenizer)
    if change == "file content (same size)":
        size = os.path.getsize(sft_files[1])
        _same_size_edit(sft_files[1])
        assert os.path.getsize(sft_files[1]) == size
    elif change == "max_length":
        data = data.model_copy(update={"max_length": 65})
    elif change == "overlong":
        data = data.model_copy(update={"overlong": "drop"})
    elif change == "system":
        data = data.model_copy(update={"system": "You are terse."})
    elif change == "format":
        data = DataSection(train=[{"path": sft_files[0], "format": "alpaca"}, sft_files[1]], max_length=64)
    elif change == "max_samples":
        data = DataSection(train=[{"path": sft_files[0], "max_samples": 39}, sft_files[1]], max_length=64)
    elif change == "tokenizer vocabulary":
        tokenizer = copy.deepcopy(ernie_tokenizer)
        tokenizer.add_tokens(["erniekitcachetoken"])
    elif change == "chat template":
        tokenizer = copy.deepcopy(ernie_tokenizer)
        tokenizer.chat_template = ernie_tokenizer.chat_template + " "
    fresh, _ = _run(data.model_copy(update={"cache": False}), tokenizer)
    result, log = _run(data, tokenizer)
    assert log.hits == 0, f"a changed {change} must not reuse the old entry"
    assert result == fresh
    assert len(list(cache_root.glob("*.npz"))) == 2


def test_sft_and_dpo_entries_of_one_file_are_separate(ernie_tokenizer, tmp_path, cache_root):
    path = tmp_path / "both.jsonl"  # alpaca records that read as SFT (output) and as preferences (chosen/rejected)
    records = [{"instruction": f"q{i}", "output": f"a{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in records))
    data = DataSection(train=[str(path)], max_length=64)
    _run(data, ernie_tokenizer, pairs=True)
    _, log = _run(data, ernie_tokenizer)
    assert log.hits == 0 and len(list(cache_root.glob("*.npz"))) == 2


def test_hub_ids_and_small_files_are_not_cached(tmp_path, monkeypatch):
    small = tmp_path / "small.jsonl"
    small.write_text('{"src": ["q"], "tgt": ["a"]}\n')
    assert cache.local_files(["someone/some-dataset"]) is None
    assert cache.local_files([str(small), "someone/some-dataset"]) is None
    assert cache.local_files([str(small)]) is None  # under MIN_BYTES
    monkeypatch.setattr(cache, "MIN_BYTES", 0)
    assert cache.local_files([str(small)]) == [small]


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("ERNIEKIT_CACHE", str(tmp_path / "ek"))
    assert cache.cache_dir() == tmp_path / "ek" / "data"
    monkeypatch.delenv("ERNIEKIT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "erniekit-lite" / "data"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.cache_dir() == cache.Path.home() / ".cache" / "erniekit-lite" / "data"


# ---------------------------------------------------------------------------------------------------------------
# Damaged entries are rebuilt; failed writes leave nothing behind and do not stop the run
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "other key"])
def test_damaged_entry_is_ignored_and_rebuilt(ernie_tokenizer, sft_files, cache_root, damage):
    data = _sft(sft_files)
    fresh, _ = _run(data, ernie_tokenizer)
    (entry,) = cache_root.glob("*.npz")
    if damage == "truncated":
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    elif damage == "garbage":
        entry.write_bytes(b"\x00not a zip" * 100)
    elif damage == "empty":
        entry.write_bytes(b"")
    else:  # a whole, valid entry filed under the wrong name
        other = DataSection(train=[sft_files[0]], max_length=64)
        _run(other, ernie_tokenizer)
        (moved,) = set(cache_root.glob("*.npz")) - {entry}
        shutil.move(moved, entry)
    rebuilt, log = _run(data, ernie_tokenizer)
    assert log.hits == 0 and rebuilt == fresh
    again, log = _run(data, ernie_tokenizer)
    assert log.hits == 1 and again == fresh  # the rebuilt entry is whole


def test_failed_write_leaves_no_entry_and_the_run_goes_on(ernie_tokenizer, sft_files, cache_root, monkeypatch):
    import numpy as np

    def savez_then_fail(file, **arrays):
        file.write(b"PK\x03\x04 partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", savez_then_fail)
    data = _sft(sft_files)
    result, log = _run(data, ernie_tokenizer)
    assert result == _run(data.model_copy(update={"cache": False}), ernie_tokenizer)[0]
    assert any("not written" in line and "No space left" in line for line in log)
    assert list(cache_root.iterdir()) == []  # neither an entry nor the temporary file


def test_entries_unused_for_a_month_are_pruned(ernie_tokenizer, sft_files, cache_root):
    _run(_sft(sft_files), ernie_tokenizer)
    (old,) = cache_root.glob("*.npz")
    stale = cache_root / ".interrupted.tmp"
    stale.write_bytes(b"partial")
    month_ago = old.stat().st_mtime - 31 * 86400
    os.utime(old, (month_ago, month_ago))
    os.utime(stale, (month_ago, month_ago))
    _run(_sft(sft_files, max_length=80), ernie_tokenizer)  # writes a new entry, which prunes
    assert not old.exists() and not stale.exists() and len(list(cache_root.glob("*.npz"))) == 1


# ---------------------------------------------------------------------------------------------------------------
# Parallel tokenization: the same samples, order and statistics for any num_proc
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def forks(monkeypatch):
    """Counts the process pools prepare starts, so a test knows the parallel path really ran."""
    started = []
    real = prepare_module._fork_pool

    def counting(processes, job):
        started.append(processes)
        return real(processes, job)

    monkeypatch.setattr(prepare_module, "_fork_pool", counting)
    return started


def test_num_proc_gives_identical_sft_data(ernie_tokenizer, sft_files, forks, monkeypatch):
    data = _sft(sft_files, cache=False, eval_split=0.1)
    one, _ = _run(data.model_copy(update={"num_proc": 1}), ernie_tokenizer)
    monkeypatch.setattr(prepare_module, "_CHUNK", 7)  # in-process chunks add up the same way
    assert _run(data.model_copy(update={"num_proc": 1}), ernie_tokenizer)[0] == one
    for n in (2, 3):
        assert _run(data.model_copy(update={"num_proc": n}), ernie_tokenizer)[0] == one
    assert forks == [2, 3]


def test_num_proc_gives_identical_pairs(ernie_tokenizer, dpo_file, forks):
    data = DataSection(train=[dpo_file], max_length=64, cache=False)
    one, _ = _run(data.model_copy(update={"num_proc": 1}), ernie_tokenizer, pairs=True)
    assert _run(data.model_copy(update={"num_proc": 2}), ernie_tokenizer, pairs=True)[0] == one
    assert forks == [2]


def test_an_error_in_a_worker_is_the_error_one_process_raises(ernie_tokenizer, sft_files, forks, monkeypatch):
    real = ErnieTemplate.pieces

    def refuse_some(self, conv):
        question = conv.turns[0].user
        if question.startswith(("question 9.", "question 25.")):
            raise UserError(f"cannot render {question.split()[1]}")
        return real(self, conv)

    monkeypatch.setattr(ErnieTemplate, "pieces", refuse_some)  # forked workers inherit the patch
    data = _sft(sft_files, cache=False)
    for n in (1, 3):
        with pytest.raises(UserError, match=r"^cannot render 9\.0$"):
            _run(data.model_copy(update={"num_proc": n}), ernie_tokenizer)
    assert forks == [3]


def test_auto_num_proc(monkeypatch):
    processes = prepare_module._processes
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(2)), raising=False)
    assert processes(None, 1_000_000) == 1  # 2 cores: the tokenizer's own threads already use both
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # as `erniekit-lite` sets it
    assert processes(None, 1_000_000) == 2 and processes(None, 9_999) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)), raising=False)
    assert processes(None, 4_999) == 1
    assert processes(None, 20_000) == 4
    assert processes(None, 1_000_000) == 16
    assert processes(3, 10) == 3 and processes(8, 5) == 5 and processes(4, 1) == 1
