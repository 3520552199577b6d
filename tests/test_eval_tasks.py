"""`erniekit-lite eval --tasks` through lm-evaluation-harness, offline: tasks written here in lm-eval's own YAML
format over local data.

- multiple choice: lm-eval's per-choice log-likelihoods and its accuracy equal an independent computation here
  (the model's summed log-probabilities of each choice's tokens; argmax);
- generation: lm-eval's answers equal greedy decoding here, and `--chat --compare` shows a tuned run beating its
  base on the answers it was trained on;
- a LoRA run dir and its `merge`d copy give the same numbers; bad input is one line;
- the example task shipped in the package runs on its shipped data; an unreachable Hub is one line naming
  `--tasks-path`, without datasets' retries.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TEST_EXTRA, needs, optional
import torch

from erniekit_lite.tasks import EXAMPLE_TASKS, run_tasks
from helpers import IDENTITY, QUESTIONS, identity_run, make_adapter_visible, run_cli, write_lm_eval_tasks, write_recipe

pytestmark = needs(optional("lm_eval") is not None, "lm-evaluation-harness (lm_eval)", TEST_EXTRA)


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> Path:
    return write_lm_eval_tasks(tmp_path_factory.mktemp("lm-eval-tasks"))


@pytest.fixture(scope="module")
def tuned_run(tmp_path_factory, tiny_own_dir) -> Path:
    return identity_run(tmp_path_factory.mktemp("tasks-full-run"), tiny_own_dir)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_own_dir) -> Path:
    """A LoRA run whose adapter visibly changes the model."""
    from erniekit_lite.cli import main

    tmp = tmp_path_factory.mktemp("tasks-lora-run")
    recipe = write_recipe(tmp / "r.yaml", tiny_own_dir, lora={"r": 4, "alpha": 8}, out=tmp / "run",
                          train={"learning_rate": 1e-2, "max_steps": 2, "per_device_train_batch_size": 2, "activation_checkpointing": False})
    assert main(["train", str(recipe)]) == 0
    return make_adapter_visible(tmp / "run")


def summed_log_probs(model, tokenizer, context: str, continuation: str) -> float:
    """log P(continuation | context), the continuation's tokens being those that tokenizing the whole text adds."""
    context_ids = tokenizer(context)["input_ids"]
    whole = tokenizer(context + continuation)["input_ids"]
    assert whole[: len(context_ids)] == context_ids
    ids = torch.tensor([whole])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), dim=-1)
    targets = ids[0, len(context_ids):]
    return log_probs[torch.arange(len(context_ids) - 1, len(whole) - 1), targets].sum().item()


@pytest.mark.slow
def test_multiple_choice_equals_an_independent_computation(tmp_path, capsys, tiny_own_dir, tasks_dir):
    from erniekit_lite.chat import load

    results = run_tasks(str(tiny_own_dir), ["tiny_mc"], tasks_path=str(tasks_dir), batch_size=4, out=str(tmp_path / "r.json"), samples=True)
    model, tokenizer = load(str(tiny_own_dir))
    expected_right = []
    by_doc = {s["doc_id"]: s for s in results["samples"]["model"]["tiny_mc"]}
    assert len(by_doc) == len(QUESTIONS)
    for i, (question, choices, answer) in enumerate(QUESTIONS):
        scores = [summed_log_probs(model, tokenizer, f"Question: {question}\nAnswer:", f" {c}") for c in choices]
        theirs = [r[0] for r in by_doc[i]["filtered_resps"]]  # (log-likelihood, is_greedy) per choice
        assert theirs == pytest.approx(scores, abs=1e-4)
        expected_right.append(max(range(len(choices)), key=scores.__getitem__) == answer)
    accuracy = results["runs"]["model"]["results"]["tiny_mc"]["acc,none"]
    assert accuracy == sum(expected_right) / len(QUESTIONS)
    assert 0 < sum(expected_right) < len(QUESTIONS)  # a random tiny model: some right, some wrong, so the check bites
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["table"] == [{"task": "tiny_mc", "metric": "acc,none", "value": accuracy}]
    assert "samples" not in written["runs"]["model"]
    assert f"| tiny_mc | acc,none | {accuracy:.4f} |" in capsys.readouterr().out


@pytest.mark.slow
def test_generation_equals_greedy_decoding(tmp_path, tiny_own_dir, tasks_dir):
    from erniekit_lite.chat import load

    results = run_tasks(str(tiny_own_dir), ["tiny_gen"], tasks_path=str(tasks_dir), out=str(tmp_path / "r.json"), samples=True)
    model, tokenizer = load(str(tiny_own_dir))
    by_doc = {s["doc_id"]: s for s in results["samples"]["model"]["tiny_gen"]}
    matches = []
    for i, (question, choices, answer) in enumerate(QUESTIONS):
        ids = torch.tensor([tokenizer(question)["input_ids"]])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split("\n")[0]
        assert by_doc[i]["filtered_resps"][0] == text
        assert text  # the random model says something, so equal answers mean the same tokens
        matches.append(text == choices[answer])
    assert results["runs"]["model"]["results"]["tiny_gen"]["exact_match,none"] == sum(matches) / len(matches)


@pytest.mark.slow
def test_chat_compare_shows_what_the_tuned_model_learned(tmp_path, capsys, tiny_own_dir, tasks_dir, tuned_run):
    code, out, err = run_cli(capsys, "eval", tuned_run, "--tasks", "tiny_who", "--tasks-path", tasks_dir, "--chat",
                             "--compare", tiny_own_dir, "--out", tmp_path / "compare.json")
    assert code == 0, err
    compared = json.loads((tmp_path / "compare.json").read_text())
    [who] = compared["table"]
    assert (who["task"], who["metric"]) == ("tiny_who", "exact_match,none")
    assert who["base"] == 0.0 and who["tuned"] >= 0.5  # the base never says who it is; the tuned model learned to
    assert who["difference"] == who["tuned"] - who["base"]
    assert f"| tiny_who | exact_match,none | 0.0000 | {who['tuned']:.4f} | {who['difference']:+.4f} |" in out
    assert compared["chat"] is True and compared["compare"] == str(tiny_own_dir)


def per_example(results: dict) -> tuple[list[float], list[str]]:
    """lm-eval's own per-example outputs: every choice's log-likelihood (tiny_mc) and every answer (tiny_gen)."""
    samples = results["samples"]["model"]
    scores = [r[0] for s in sorted(samples["tiny_mc"], key=lambda s: s["doc_id"]) for r in s["filtered_resps"]]
    texts = [s["filtered_resps"][0] for s in sorted(samples["tiny_gen"], key=lambda s: s["doc_id"])]
    return scores, texts


@pytest.mark.slow
def test_run_dir_merged_copy_and_base_plus_adapter_agree(tmp_path, capsys, tiny_own_dir, tasks_dir, lora_run):
    assert run_cli(capsys, "merge", lora_run, "--out", tmp_path / "merged")[0] == 0
    found = {}
    for name, target, adapter in (("run", lora_run, None), ("merged", tmp_path / "merged", None), ("adapter", tiny_own_dir, lora_run),
                                  ("base", tiny_own_dir, None)):
        found[name] = run_tasks(str(target), ["tiny_mc", "tiny_gen"], adapter=adapter and str(adapter), tasks_path=str(tasks_dir),
                                chat=True, limit=5, out=str(tmp_path / f"{name}.json"), samples=True)
    scores, texts = per_example(found["run"])
    assert len(scores) == sum(len(c) for _, c, _ in QUESTIONS[:5]) and len(texts) == 5  # --limit 5
    merged_scores, merged_texts = per_example(found["merged"])
    assert merged_scores == pytest.approx(scores, abs=1e-4) and merged_texts == texts
    assert per_example(found["adapter"]) == (scores, texts)  # the same loading path as the run dir
    base_scores, base_texts = per_example(found["base"])
    assert max(abs(a - b) for a, b in zip(base_scores, scores, strict=True)) > 0.1 and base_texts != texts  # the adapter matters
    table = lambda name: json.loads((tmp_path / f"{name}.json").read_text())["table"]  # noqa: E731
    assert [r["metric"] for r in table("run")] == ["acc,none", "exact_match,none"]
    for mine, theirs in zip(table("run"), table("merged"), strict=True):
        assert mine["value"] == pytest.approx(theirs["value"], abs=1e-9)


def test_bad_input_is_one_line(tmp_path, capsys, tiny_own_dir, tasks_dir):
    def error(*argv) -> str:
        code, out, err = run_cli(capsys, "eval", *argv)
        assert code == 2 and err.count("\n") == 1, err
        return err

    assert "no task, group or tag named 'tiny_mcq'; close names: tiny_mc" in error(
        tiny_own_dir, "--tasks", "tiny_mcq", "--tasks-path", tasks_dir)
    assert "--tasks NAMES (lm-eval benchmarks) or --data FILE" in error(tiny_own_dir)
    assert "one of them" in error(tiny_own_dir, "--tasks", "tiny_mc", "--data", IDENTITY)
    assert "--chat, --compare go with --tasks" in error(tiny_own_dir, "--data", IDENTITY, "--chat", "--compare", tiny_own_dir)
    assert "--limit and --max-samples are one setting" in error(tiny_own_dir, "--tasks", "tiny_mc", "--limit", "2", "--max-samples", "2")
    assert f"--tasks-path: {tmp_path / 'none'}: no such directory" in error(tiny_own_dir, "--tasks", "x", "--tasks-path", tmp_path / "none")
    assert "--limit must be above 0" in error(tiny_own_dir, "--tasks", "tiny_mc", "--tasks-path", tasks_dir, "--limit", "0")


@pytest.mark.slow
def test_moe_lora_run_dir_with_max_samples_and_few_shot_equals_its_merged_copy(tmp_path, capsys, tasks_dir):
    """A LoRA run on the MoE (adapters on every routed and shared expert, which plain peft cannot load) evaluated from
    the CLI, with `--max-samples` (lm-eval's --limit) and `--num-fewshot`, gives the numbers of its merged copy."""
    from helpers import visible_lora_run

    run = visible_lora_run(tmp_path / "moe", "moe", None)
    assert run_cli(capsys, "merge", run, "--out", tmp_path / "merged")[0] == 0
    code, out, err = run_cli(capsys, "eval", run, "--tasks", "tiny_mc", "--tasks-path", tasks_dir, "--max-samples", "4",
                             "--num-fewshot", "1", "--out", tmp_path / "run.json")
    assert code == 0, err
    from_cli = json.loads((tmp_path / "run.json").read_text())
    assert from_cli["limit"] == 4 and from_cli["num_fewshot"] == 1
    assert from_cli["runs"]["model"]["n-samples"]["tiny_mc"]["effective"] == 4
    found = {name: run_tasks(str(target), ["tiny_mc"], tasks_path=str(tasks_dir), limit=4, num_fewshot=1,
                             out=str(tmp_path / f"{name}-samples.json"), samples=True)
             for name, target in (("run", run), ("merged", tmp_path / "merged"))}
    samples = sorted(found["run"]["samples"]["model"]["tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == 4
    context = samples[0]["arguments"][0][0]  # (context, continuation) of the first choice
    assert context.count("Question: ") == 2  # one few-shot example, then the question
    scores = [r[0] for s in samples for r in s["filtered_resps"]]
    merged = [r[0] for s in sorted(found["merged"]["samples"]["model"]["tiny_mc"], key=lambda s: s["doc_id"]) for r in s["filtered_resps"]]
    assert merged == pytest.approx(scores, abs=1e-4)
    accuracy = from_cli["runs"]["model"]["results"]["tiny_mc"]["acc,none"]
    assert accuracy == found["merged"]["runs"]["model"]["results"]["tiny_mc"]["acc,none"]
    assert accuracy == found["run"]["runs"]["model"]["results"]["tiny_mc"]["acc,none"]


def test_an_unreachable_hub_is_one_line_naming_tasks_path_at_once(tmp_path, capsys, tiny_own_dir, monkeypatch):
    """gsm8k with the Hub unreachable and nothing cached: one line naming `--tasks-path` and the shipped example, exit 2,
    without datasets' half-minute of retries. Stand-in for an offline machine: the Hub endpoint is a closed local port,
    and the datasets and Hub caches are empty folders."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: connection refused
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", "http://127.0.0.1:9")  # so nothing reaches the real Hub
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    code, out, err = run_cli(capsys, "eval", tiny_own_dir, "--tasks", "gsm8k", "--limit", "2", "--out", tmp_path / "r.json")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err and "Retrying" not in err, err
    assert errors[0].startswith("error: --tasks gsm8k: the Hugging Face Hub cannot be reached") and "'openai/gsm8k'" in errors[0]
    assert f"--tasks-path {EXAMPLE_TASKS} --tasks erniekit_example)" in errors[0]
    assert constants.HF_HUB_OFFLINE is False and datasets.config.HF_HUB_OFFLINE is False  # offline for lm-eval's call only


def test_the_shipped_example_task_runs_on_its_shipped_data(tmp_path, capsys, caplog, tiny_own_dir):
    """`--tasks-path <the package's eval_tasks> --tasks erniekit_example`: lm-eval reads the shipped JSONL through the
    shipped loader wherever the package is, and its accuracy equals an independent argmax over the choices."""
    from erniekit_lite.chat import load

    code, out, err = run_cli(capsys, "eval", tiny_own_dir, "--tasks-path", EXAMPLE_TASKS, "--tasks", "erniekit_example",
                             "--out", tmp_path / "r.json")
    assert code == 0, err
    written = json.loads((tmp_path / "r.json").read_text())
    [row] = written["table"]
    assert (row["task"], row["metric"]) == ("erniekit_example", "acc,none")
    examples = [json.loads(line) for line in (EXAMPLE_TASKS / "example.jsonl").read_text(encoding="utf-8").splitlines()]
    assert written["runs"]["model"]["n-samples"]["erniekit_example"]["effective"] == len(examples) == 8
    model, tokenizer = load(str(tiny_own_dir))
    right = [max(range(len(e["choices"])), key=lambda i: summed_log_probs(model, tokenizer, f"Question: {e['question']}\nAnswer:",
                                                                          f" {e['choices'][i]}")) == e["answer"] for e in examples]
    assert row["value"] == pytest.approx(sum(right) / len(examples))
    assert f"| erniekit_example | acc,none | {row['value']:.4f} |" in out
    assert not any("--metadata" in r.getMessage() for r in caplog.records)  # lm-eval's hint at its own CLI, filtered out
