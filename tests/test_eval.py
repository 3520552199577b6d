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

    The Trainer alone would average the per-batch losses; the project's Trainer (train/trainer.py) reports the token-weighted mean over the
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
                               "--max-new-tokens", tokens, "--out", tmp_path / f"{name}.jsonl")
        assert code == 0, err
        files[name] = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert json.loads((tmp_path / f"{name}.metrics.json").read_text())["generations"] == str(tmp_path / f"{name}.jsonl")
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
                           "--max-new-tokens", 6, "--out", tmp_path / "r.jsonl")
    assert code == 0, err
    generated = [json.loads(line)["answer"] for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert generated == one_at_a_time(tiny_dense_dir, [json.loads(line) for line in data.read_text().splitlines()[:6]], 6)


METRICS = {"model", "data", "format", "max_length", "system", "records", "samples", "truncated", "dropped_overlong",
           "dropped_untrained", "eval_loss", "eval_perplexity", "eval_tokens", "generations"}
ANSWER = {"line", "prompt", "reference", "answer"}


def test_default_output_goes_to_the_runs_folder_never_the_working_folder(tmp_path, capsys, monkeypatch, lora_run):
    """Issue 75: `eval RUN --data FILE` wrote eval_results.json into the working folder (a clone's `git status` showed it).
    Now it goes to RUN/eval/, new numbers each time, and nothing is written where the command runs."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    home, run_files = lora_run / "eval", sorted(p.name for p in lora_run.iterdir())
    assert not home.exists()
    for n in ("", "-2"):  # the second never over the first
        code, out, err = run_cli(capsys, "eval", lora_run, "--data", IDENTITY, "--max-samples", 2, "--generate", "--max-new-tokens", 2)
        assert code == 0, err
        assert f"wrote {home / f'eval_results{n}.json'}" in out and f"written to {home / f'eval_generations{n}.jsonl'}" in out
    assert list(work.iterdir()) == []
    assert sorted(p.name for p in lora_run.iterdir()) == sorted(run_files + ["eval"])  # the run's own files as they were
    assert sorted(p.name for p in home.iterdir()) == ["eval_generations-2.jsonl", "eval_generations.jsonl", "eval_results-2.json",
                                                      "eval_results.json"]
    results = json.loads((home / "eval_results.json").read_text())
    assert set(results) == METRICS and results["generations"] == str(home / "eval_generations.jsonl")
    assert (results["model"], results["records"]) == (str(lora_run), 2)
    answers = [json.loads(line) for line in (home / "eval_generations.jsonl").read_text().splitlines()]
    assert [set(a) for a in answers] == [ANSWER] * 2 and [a["line"] for a in answers] == [1, 2]


def test_generate_out_names_the_answers_and_the_metrics_go_beside_it(tmp_path, capsys, monkeypatch, tiny_own_dir):
    """With --generate, --out FILE holds the answers and FILE's suffix becomes .metrics.json for the metrics, as --help
    says; an existing file (either) is one line naming it, unless --overwrite."""
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert ("with --out FILE: FILE holds the answers, and the metrics go beside it, FILE's suffix replaced by .metrics.json: "
            "answers.jsonl -> answers.metrics.json") in said
    assert "Default: the folder of the model evaluated (the run's output dir" in said and "never the working folder" in said

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    answers, metrics = tmp_path / "out" / "answers.jsonl", tmp_path / "out" / "answers.metrics.json"
    argv = [tiny_own_dir, "--data", IDENTITY, "--max-samples", 2, "--generate", "--max-new-tokens", 2, "--out", answers]
    code, out, err = run_cli(capsys, "eval", *argv)
    assert code == 0, err
    assert sorted(p.name for p in answers.parent.iterdir()) == ["answers.jsonl", "answers.metrics.json"]
    assert list(work.iterdir()) == [] and not (tiny_own_dir / "eval").exists()
    results = json.loads(metrics.read_text())
    assert set(results) == METRICS and results["generations"] == str(answers) and results["records"] == 2
    lines = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [set(line) for line in lines] == [ANSWER] * 2
    assert [line["prompt"] for line in lines] == [r["src"][-1] for r in RECORDS[:2]]

    def refused(*more) -> str:
        code, _, err = run_cli(capsys, "eval", *argv, *more)
        assert code == 2 and err.count("\n") == 1, err
        return err

    kept = answers.read_text(), metrics.read_text()
    assert f"--out: {answers} exists; choose another --out, or --overwrite" in refused()
    answers.unlink()
    assert f"--out: {metrics} exists" in refused()  # the file beside it counts too
    assert not answers.exists() and metrics.read_text() == kept[1]
    code, _, err = run_cli(capsys, "eval", *argv[:4], 1, *argv[5:], "--overwrite")  # --max-samples 1
    assert code == 0, err
    assert len(answers.read_text().splitlines()) == 1 and json.loads(metrics.read_text())["records"] == 1


def test_tasks_results_follow_the_same_rule(tmp_path, capsys, monkeypatch, lora_run, tiny_own_dir):
    """`eval --tasks` wrote into the working folder too: it now gets the run's eval/ folder (with --adapter, the
    adapter's run), an existing --out is refused the same way, and a Hub id needs --out."""
    import erniekit_lite.tasks as tasks

    handed = []
    monkeypatch.setattr(tasks, "run_tasks", lambda *args: handed.append(args[-1]))  # lm-eval itself: tests/test_eval_tasks.py
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert run_cli(capsys, "eval", lora_run, "--tasks", "x")[0] == 0
    assert run_cli(capsys, "eval", tiny_own_dir, "--adapter", lora_run, "--tasks", "x")[0] == 0
    first = Path(handed[0])
    assert handed == [str(first)] * 2 and first.parent == lora_run / "eval" and not first.exists()
    assert first.name in ("eval_results.json", "eval_results-3.json")  # -3: after the test above
    (tmp_path / "mine.json").write_text("mine")
    code, _, err = run_cli(capsys, "eval", lora_run, "--tasks", "x", "--out", tmp_path / "mine.json")
    assert code == 2 and f"--out: {tmp_path / 'mine.json'} exists" in err
    assert run_cli(capsys, "eval", lora_run, "--tasks", "x", "--out", tmp_path / "mine.json", "--overwrite")[0] == 0
    code, _, err = run_cli(capsys, "eval", "some-org/some-model", "--tasks", "x")
    assert code == 2 and "some-org/some-model is not a local folder to keep the results in; say where they go with --out FILE" in err
    assert handed[2:] == [str(tmp_path / "mine.json")] and list(work.iterdir()) == []


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
    # where the results go: asked before any model loads
    assert (f"--out {tmp_path / 'r.json'}: with --generate, --out names the answers file (JSONL)" in
            bad(tiny_own_dir, "--data", IDENTITY, "--generate", "--out", tmp_path / "r.json"))
    assert f"--out: {tmp_path} is a directory; give a file name" in bad(tiny_own_dir, "--data", IDENTITY, "--out", tmp_path)
    assert "--overwrite goes with --out" in bad(tiny_own_dir, "--data", IDENTITY, "--overwrite")
    assert "eval: some-org/some-model is not a local folder to keep the results in; say where they go with --out FILE" in bad(
        "some-org/some-model", "--data", IDENTITY)  # a Hub id: the working folder is never guessed
    hub_recipe = eval_recipe(tmp_path / "hub.yaml", "some-org/some-model", tmp_path / "out")
    assert f"{hub_recipe}: its model.path some-org/some-model is not a local folder" in bad(hub_recipe, "--data", IDENTITY)
    assert not list(tmp_path.glob("eval*")) and not (tiny_own_dir / "eval").exists()
