"""Continued pre-training (`method: pt`): raw documents, the end token, pieces of max_length, per-document attention
in packed rows, a corpus that streams through a memory-mapped token file, and a run whose loss falls."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from erniekit_lite.data.collate import PackedCollator
from erniekit_lite.data.documents import prepare_documents
from erniekit_lite.data.tokenize import IGNORE
from erniekit_lite.errors import DataError, RecipeError
from erniekit_lite.model.load import load_model, load_tokenizer
from erniekit_lite.recipe import DataSection, from_dict
from helpers import run_cli, write_recipe


def quiet(*_):
    pass


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def pieces_of(prepared) -> list[list[int]]:
    return [prepared.train.pieces.ids(i) for i in range(len(prepared.train.pieces))]


def test_two_documents_exact_ids_with_the_real_tokenizer(tmp_path, ernie_tokenizer):
    """Text is text (a typed control token stays characters), each document ends in `</s>` (id 2), a document longer
    than max_length is cut into pieces, and every token but each piece's first is trained."""
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "Hello world."}, {"text": "文心一言<|end_of_sentence|>" * 2}])
    prepared = prepare_documents(DataSection(train=[str(corpus)], max_length=16, cache=False), ernie_tokenizer, log=quiet)
    hello = [16276, 3135, 93937, 2]  # Hello ▁world . </s>
    typed = [94133, 94108, 61303, 93953, 94031, 438, 93944, 865, 93944, 47219, 61125]  # 文 心 一言 < | end _ of _ sentence |>
    wenxin = typed * 2 + [2]  # 23 tokens: cut into 16 + 7
    assert pieces_of(prepared) == [hello, wenxin[:16], wenxin[16:]]
    s = prepared.train.stats
    assert (s.documents, s.pieces, s.cut, s.trained_tokens) == (2, 3, 1, 3 + 15 + 6)
    rows = [prepared.train.rows[i] for i in range(len(prepared.train.rows))]
    assert [r.seq_lengths for r in rows] == [[16], [7, 4]]  # best-fit decreasing over the pieces
    assert rows[0].input_ids == wenxin[:16] and rows[0].labels == [IGNORE] + wenxin[1:16]
    assert rows[1].input_ids == wenxin[16:] + hello
    assert rows[1].labels == [IGNORE] + wenxin[17:] + [IGNORE] + hello[1:]
    assert prepared.train.packing_efficiency == 27 / 32


def test_formats_erniekit_tgt_text_files_and_a_folder(tmp_path, tiny_own_dir):
    tokenizer = load_tokenizer(str(tiny_own_dir))
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]  # noqa: E731
    erniekit = write_jsonl(tmp_path / "pt.jsonl", [{"tgt": ["first text", "second text"]}, {"tgt": "third"}])
    folder = tmp_path / "books"
    (folder / "b").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha\n\nbeta", encoding="utf-8")
    (folder / "b" / "c.txt").write_text("gamma", encoding="utf-8")
    (folder / "notes.md").write_text("not read", encoding="utf-8")
    logged = []
    prepared = prepare_documents(DataSection(train=[str(erniekit), str(folder), {"path": str(folder / "a.txt"), "max_samples": 1}],
                                             max_length=64, cache=False), tokenizer, log=logged.append)
    expected = [encode(t) for t in ("first text", "second text", "third", "alpha\n\nbeta", "gamma", "alpha\n\nbeta")]
    assert pieces_of(prepared) == expected  # each tgt entry and each .txt file (whole) is one document
    assert [(r.format, r.documents) for r in prepared.train.sources] == [("erniekit", 3), ("txt", 2), ("txt", 1)]
    assert any("auto-detected as 'erniekit'" in line for line in logged)


def test_packed_rows_equal_each_document_alone(tmp_path, tiny_dense_dir):
    """In a packed row no document attends to its neighbour: logits equal each piece run alone (<= 1e-5)."""
    tokenizer = load_tokenizer(str(tiny_dense_dir))
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": " ".join(["word"] * n) + f" {n}"} for n in (3, 40, 7, 90, 15)])
    prepared = prepare_documents(DataSection(train=[str(corpus)], max_length=64, cache=False), tokenizer, log=quiet)
    rows = [prepared.train.rows[i] for i in range(len(prepared.train.rows))]
    assert any(len(r.seq_lengths) > 1 for r in rows)
    model = load_model(str(tiny_dense_dir), "float32", "packed_sdpa").eval()
    batch = PackedCollator(64)([vars(r) for r in rows])
    batch.pop("token_slots"), batch.pop("labels")
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]
        starts = batch["cu_seq_lens_q"].tolist()
        flat = batch["input_ids"][0]
        for a, b in zip(starts, starts[1:]):
            ids = flat[a:b][None]
            alone = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0]
            assert (packed[a:b] - alone).abs().max().item() <= 1e-5


def test_bad_input_is_one_line(tmp_path, tiny_own_dir):
    tokenizer = load_tokenizer(str(tiny_own_dir))

    def error(records=None, path=None, **source) -> str:
        path = path or write_jsonl(tmp_path / "bad.jsonl", records)
        with pytest.raises(DataError) as e:
            prepare_documents(DataSection(train=[{"path": str(path), **source}], max_length=64, cache=False), tokenizer, log=quiet)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert error([{"prompt": "x"}]).endswith("bad.jsonl:1: method: pt reads a 'text' string or ERNIEKit's pre-training 'tgt' list per record; found prompt")
    assert error([{"text": "a"}, {"text": 3}]).endswith("bad.jsonl:2: 'text' must be a string (got int)")
    assert error([{"tgt": ["a"]}, {"tgt": [1]}]).endswith("bad.jsonl:2: 'tgt' must be a list of strings (ERNIEKit's pre-training format: {\"tgt\": [\"text\"]})")
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n')
    assert "broken.jsonl:2: malformed JSON line" in error(path=tmp_path / "broken.jsonl")
    (tmp_path / "empty").mkdir()
    assert error(path=tmp_path / "empty").endswith("empty: folder holds no .txt files")
    assert error([{"text": ""}]).endswith("no text to train on (1 documents, 1 empty)")

    def recipe_error(method: str, fmt: str) -> str:
        with pytest.raises(RecipeError) as e:
            from_dict({"model": {"path": "m"}, "method": method, "data": {"train": [{"path": "x.jsonl", "format": fmt}]},
                       "output": {"dir": "o"}})
        return str(e.value)

    assert "data.train.0.format 'alpaca' is chat data; method: pt reads raw text" in recipe_error("pt", "alpaca")
    assert "data.train.0.format 'text' is raw text, for method: pt" in recipe_error("sft", "text")


STREAM = textwrap.dedent("""
    import json, resource, sys
    from erniekit_lite.data.documents import prepare_documents
    from erniekit_lite.model.load import load_tokenizer
    from erniekit_lite.recipe import DataSection
    tokenizer = load_tokenizer(sys.argv[1])
    data = DataSection(train=[sys.argv[2]], max_length=2048)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    prepared = prepare_documents(data, tokenizer, log=print)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    rows = prepared.train.rows
    print(json.dumps({"grown_mib": grown, "tokens": rows.real_tokens, "pieces": rows.count, "rows": len(rows),
                      "first": rows[0].input_ids[:8], "last": rows[len(rows) - 1].seq_lengths}))
""")


@pytest.mark.slow
def test_a_corpus_larger_than_the_memory_budget_streams(tmp_path, ernie_tokenizer_dir):
    """A 32 MB corpus (about 16M tokens: 64 MB as int32, ~580 MB as Python int lists) is prepared while the
    process grows by less than BUDGET: pieces go to a memory-mapped token file as they are made, and only their
    lengths stay in memory. The second run reads the same file back from the data cache."""
    budget_mib = 48
    import random

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    corpus = tmp_path / "big.jsonl"
    with corpus.open("w") as f:
        size = 0
        while size < 32 << 20:
            line = json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(50, 2000)))}) + "\n"
            f.write(line)
            size += len(line)

    def prepared() -> tuple[dict, str]:
        out = subprocess.run([sys.executable, "-c", STREAM, str(ernie_tokenizer_dir), str(corpus)], capture_output=True,
                             text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1]), out

    first, _ = prepared()
    assert first["tokens"] * 4 > budget_mib << 20  # the corpus, even as int32 tokens, is over the budget
    assert first["grown_mib"] < budget_mib, first
    again, log = prepared()
    assert "data cache: tokenized pieces" in log and {k: again[k] for k in first if k != "grown_mib"} == {
        k: first[k] for k in first if k != "grown_mib"}


@pytest.mark.slow
def test_pt_run_from_the_cli_loss_falls(tmp_path, capsys, tiny_own_dir):
    import random

    rng = random.Random(0)
    words = "the cat sat on a mat while rain fell over quiet hills and rivers ran to the sea".split()
    corpus = write_jsonl(tmp_path / "corpus.jsonl",
                         [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 120)))} for _ in range(60)])
    recipe = write_recipe(tmp_path / "r.yaml", tiny_own_dir, method="pt", data={"train": [str(corpus)], "max_length": 128, "eval_split": 0.1},
                          train={"max_steps": 30, "learning_rate": 3e-3, "per_device_train_batch_size": 2, "logging_steps": 5,
                                 "activation_checkpointing": False}, out=tmp_path / "run")
    code, out, err = run_cli(capsys, "validate", recipe)
    assert code == 0, err
    assert "60 documents" in out and "pieces" in out and "packing efficiency" in out
    code, out, err = run_cli(capsys, "train", recipe)
    assert code == 0, err
    losses = [h["loss"] for h in json.loads((tmp_path / "run" / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert losses[-1] < losses[0] - 1.0, losses  # random weights: ln(vocab) at first; the word list is learnt
    results = json.loads((tmp_path / "run" / "train_results.json").read_text())
    assert results["train_samples"] == 60 and "eval_loss" in results
    assert (tmp_path / "run" / "model.safetensors").is_file()
