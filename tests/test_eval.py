"""`erniekit-lite eval` on tiny models: the loss equals training's eval_loss, batched answers equal one-at-a-time ones."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from erniekit_lite.cli import main
from helpers import run_cli, write_recipe

ROOT = Path(__file__).resolve().parents[1]
IDENTITY = ROOT / "recipes" / "data" / "identity.jsonl"
RECORDS = [json.loads(line) for line in IDENTITY.read_text().splitlines()]


def eval_recipe(path: Path, model_dir: Path, out_dir: Path, lora: dict | None = None, train: dict | None = None, **data) -> Path:
    train = {"learning_rate": 2e-2, "max_steps": 20, "per_device_train_batch_size": 1, "activation_checkpointing": False,
             "logging_steps": 5, "save_steps": 100, "seed": 0, **(train or {})}
    return write_recipe(path, model_dir, data=data, train=train, out=out_dir, lora=lora)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_own_dir) -> Path:
    """A LoRA run that evaluated identity.jsonl itself, one packed row per eval batch (6 batches of unequal length).

    The Trainer alone would average the per-batch losses; ErnieSFTTrainer reports the token-weighted mean over the
    whole set, which is what `eval` computes.
    """
    tmp = tmp_path_factory.mktemp("eval-run")
    recipe = eval_recipe(tmp / "recipe.yaml", tiny_own_dir, tmp / "out", lora={"r": 8, "alpha": 16}, eval=[str(IDENTITY)],
                          train={"per_device_eval_batch_size": 1})
    assert main(["train", str(recipe)]) == 0
    return tmp / "out"


def test_loss_equals_training_eval_loss(tmp_path, capsys, lora_run, tiny_own_dir):
    code, out, err = run_cli(capsys, "eval", lora_run, "--data", IDENTITY, "--out", tmp_path / "r.json")
    assert code == 0, err
    results = json.loads((tmp_path / "r.json").read_text())
    trained = json.loads((lora_run / "train_results.json").read_text())
    assert abs(results["eval_loss"] - trained["eval_loss"]) < 1e-5
    assert results["eval_perplexity"] == math.exp(results["eval_loss"])
    assert f"wrote {tmp_path / 'r.json'}" in out and out.count("eval: loss") == 1

    # every trained label of the prepared data is scored, and nothing else
    from transformers import AutoTokenizer

    from erniekit_lite.data.prepare import prepare
    from erniekit_lite.data.tokenize import IGNORE
    from erniekit_lite.recipe import DataSection

    tokenizer = AutoTokenizer.from_pretrained(lora_run)
    split = prepare(DataSection(train=[str(IDENTITY)], max_length=2048), tokenizer, log=lambda _: None).train
    assert results["eval_tokens"] == sum(label != IGNORE for s in split.samples for label in s.labels)
    assert (results["records"], results["samples"], results["max_length"]) == (18, 18, 2048)

    # the base scores worse on what the adapter was trained on
    code, _, err = run_cli(capsys, "eval", tiny_own_dir, "--data", IDENTITY, "--out", tmp_path / "base.json")
    assert code == 0, err
    base = json.loads((tmp_path / "base.json").read_text())
    assert base["eval_tokens"] == results["eval_tokens"] and base["eval_loss"] > results["eval_loss"]


def test_recipe_gives_model_and_data_settings(tmp_path, capsys, tiny_own_dir):
    recipe = eval_recipe(tmp_path / "r.yaml", tiny_own_dir, tmp_path / "never", system="Be brief.", max_length=32)
    code, out, err = run_cli(capsys, "eval", recipe, "--data", IDENTITY, "--out", tmp_path / "r.json", "--max-samples", 5)
    assert code == 0, err
    results = json.loads((tmp_path / "r.json").read_text())
    assert (results["model"], results["system"], results["max_length"], results["records"]) == (str(tiny_own_dir), "Be brief.", 32, 5)
    assert results["truncated"] > 0  # some identity answers do not fit 32 tokens after the system line
    assert not (tmp_path / "never").exists()  # eval never touches the recipe's output dir


def one_at_a_time(model_dir: Path, records: list[dict], max_new_tokens: int) -> list[str]:
    """Each erniekit record's last question answered alone (no padding), after its earlier turns."""
    from erniekit_lite.data.formats import Turn
    from erniekit_lite.generate import answer
    from erniekit_lite.model.load import load_model, load_tokenizer

    model, tokenizer = load_model(str(model_dir), trainable_adapter=False), load_tokenizer(str(model_dir))
    return [
        answer(model, tokenizer, r["src"][-1], r.get("system"), [Turn(q, a) for q, a in zip(r["src"], r["tgt"][:-1])], max_new_tokens)
        for r in records
    ]


def test_batched_answers_equal_one_at_a_time(tmp_path, capsys, lora_run, tiny_own_dir):
    files = {}
    for name, model, tokens in (("tuned", lora_run, 10), ("base", tiny_own_dir, 2)):
        code, _, err = run_cli(capsys, "eval", model, "--data", IDENTITY, "--generate", "--batch-size", 5,
                               "--max-new-tokens", tokens, "--out", tmp_path / f"{name}.json")
        assert code == 0, err
        files[name] = [json.loads(line) for line in (tmp_path / f"{name}.generations.jsonl").read_text().splitlines()]
        assert json.loads((tmp_path / f"{name}.json").read_text())["generations"] == str(tmp_path / f"{name}.generations.jsonl")
    tuned, base = files["tuned"], files["base"]
    assert [g["prompt"] for g in tuned] == [g["prompt"] for g in base] == [r["src"][-1] for r in RECORDS]
    assert [g["reference"] for g in tuned] == [r["tgt"][-1] for r in RECORDS]
    assert [g["line"] for g in tuned] == list(range(1, 19))

    alone = one_at_a_time(lora_run, RECORDS, 10)
    assert [g["answer"] for g in tuned] == alone
    assert len({len(text) for text in alone}) > 1  # not vacuous: rows of one batch stop at different steps


def test_batched_answers_with_the_real_tokenizer(tmp_path, capsys, tiny_dense_dir):
    from conftest import DATA_DIR

    data = DATA_DIR / "erniekit" / "sft-eval.jsonl"  # single-turn Chinese instructions of different lengths
    code, _, err = run_cli(capsys, "eval", tiny_dense_dir, "--data", data, "--max-samples", 6, "--generate", "--batch-size", 3,
                           "--max-new-tokens", 6, "--out", tmp_path / "r.json")
    assert code == 0, err
    generated = [json.loads(line)["answer"] for line in (tmp_path / "r.generations.jsonl").read_text().splitlines()]
    assert generated == one_at_a_time(tiny_dense_dir, [json.loads(line) for line in data.read_text().splitlines()[:6]], 6)


def test_default_output_never_overwrites(tmp_path, capsys, monkeypatch, tiny_own_dir):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "eval_results.json").write_text("mine")
    code, out, err = run_cli(capsys, "eval", tiny_own_dir, "--data", IDENTITY, "--max-samples", 2, "--generate", "--max-new-tokens", 2)
    assert code == 0, err
    assert (tmp_path / "eval_results.json").read_text() == "mine"
    assert json.loads((tmp_path / "eval_results-2.json").read_text())["records"] == 2
    assert len((tmp_path / "eval_generations-2.jsonl").read_text().splitlines()) == 2
    assert "wrote eval_results-2.json" in out and "eval_generations-2.jsonl" in out


def test_bad_input_is_one_line(tmp_path, capsys, monkeypatch, tiny_own_dir):
    monkeypatch.chdir(tmp_path)

    def bad(*argv) -> str:
        code, _, err = run_cli(capsys, "eval", *argv)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
        return lines[0]

    assert "missing.jsonl: file not found" in bad(tiny_own_dir, "--data", tmp_path / "missing.jsonl")
    assert "no such directory" in bad(tmp_path / "typo", "--data", IDENTITY)  # not sent to the Hub
    (tmp_path / "empty").mkdir()
    assert "not a model dir (no config.json" in bad(tmp_path / "empty", "--data", IDENTITY)
    assert "is a file" in bad(IDENTITY, "--data", IDENTITY)
    recipe = eval_recipe(tmp_path / "r.yaml", tiny_own_dir, tmp_path / "out", max_lenght=64)
    assert "unknown key 'max_lenght' in data; did you mean 'max_length'?" in bad(recipe, "--data", IDENTITY)
    assert "recipe file not found" in bad(tmp_path / "nope.yaml", "--data", IDENTITY)
    assert "--batch-size must be at least 1" in bad(tiny_own_dir, "--data", IDENTITY, "--batch-size", 0)
    assert not list(tmp_path.glob("eval_*"))
