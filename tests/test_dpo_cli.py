"""DPO through the CLI on tiny models: it learns, full and LoRA, from an SFT run, and bad preference data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers import run_cli, write_recipe

ROOT = Path(__file__).resolve().parents[1]
PAIRS = ROOT / "recipes" / "data" / "identity_dpo.jsonl"


def dpo_recipe(tmp_path: Path, model_dir, data=None, lora=True, **train) -> Path:
    train = {"beta": 0.1, "learning_rate": 5e-3, "max_steps": 30, "per_device_train_batch_size": 2, "activation_checkpointing": False,
             "logging_steps": 5, "save_steps": 30, "seed": 0, "lr_scheduler_type": "cosine", **train}
    return write_recipe(tmp_path / "dpo.yaml", model_dir, method="dpo", data=data or {"eval": [str(PAIRS)]}, train=train,
                        lora={"r": 8, "alpha": 16, "dropout": 0.0} if lora else None)


def test_lora_dpo_learns_the_preferences(tmp_path, capsys, tiny_own_dir):
    code, out, err = run_cli(capsys, "train", dpo_recipe(tmp_path, tiny_own_dir))
    assert code == 0, err
    results = json.loads((tmp_path / "out" / "train_results.json").read_text())
    # eval set = the training pairs: the tuned policy prefers the chosen answers
    assert results["eval_rewards/accuracies"] > 0.9
    assert results["eval_rewards/margins"] > 0
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "train_tokens_per_second", "packing_efficiency"):
        assert key in results
    losses = [h["loss"] for h in json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert losses[-1] < losses[0]
    assert (tmp_path / "out" / "adapter_config.json").is_file()
    assert not (tmp_path / "out" / "ref").exists()  # a new adapter's reference is the base, not a saved copy


def test_full_dpo_with_frozen_reference_and_ipo(tmp_path, capsys, tiny_own_dir):
    """Full DPO trains the policy while its reference copy stays frozen: on the same eval pairs before and after
    training, the reference log-probs (policy log-probs - reward / beta, from TRL's logged metrics) are unchanged
    while the policy's moved."""
    beta = 0.1
    recipe = dpo_recipe(tmp_path, tiny_own_dir, lora=False, max_steps=4, learning_rate=1e-4, loss_type=["ipo"], beta=beta,
                        eval_on_start=True, eval_strategy="steps", eval_steps=4)
    code, out, err = run_cli(capsys, "train", recipe)
    assert code == 0, err
    assert (tmp_path / "out" / "model.safetensors").is_file()
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    evals = [h for h in history if "eval_loss" in h]
    before, after = evals[0], evals[-1]  # at step 0, and the final evaluation
    assert (before["step"], after["step"]) == (0, 4)
    for side in ("chosen", "rejected"):
        reference = [h[f"eval_logps/{side}"] - h[f"eval_rewards/{side}"] / beta for h in (before, after)]
        assert reference[0] == pytest.approx(reference[1], abs=1e-3)
        assert abs(after[f"eval_logps/{side}"] - before[f"eval_logps/{side}"]) > 1e-2  # the policy trained
        assert before[f"eval_rewards/{side}"] == pytest.approx(0, abs=1e-4)  # at the start the policy is the reference


def test_dpo_continues_from_an_sft_lora_run(tmp_path, capsys, tiny_own_dir):
    sft = {"model": {"path": str(tiny_own_dir)}, "data": {"train": [str(ROOT / "recipes/data/identity.jsonl")], "max_length": 128},
           "lora": {"r": 4}, "output": {"dir": str(tmp_path / "sft")},
           "train": {"max_steps": 3, "activation_checkpointing": False, "save_strategy": "no"}}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(sft))
    assert run_cli(capsys, "train", tmp_path / "sft.yaml")[0] == 0
    code, out, err = run_cli(capsys, "train", dpo_recipe(tmp_path, tmp_path / "sft", lora=False, max_steps=3))
    assert code == 0, err
    adapter = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert adapter["r"] == 4  # the SFT adapter kept training
    code, _, err = run_cli(capsys, "train", dpo_recipe(tmp_path, tmp_path / "sft", max_steps=1), "output.dir=" + str(tmp_path / "o2"))
    assert code == 2 and "already a LoRA output dir" in err


def _write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def test_untrainable_pairs_are_skipped_and_counted(tmp_path, capsys, tiny_own_dir):
    good = {"src": ["q"], "tgt": [], "response": [["yes"], ["no"]], "sort": [1, 0]}
    data = _write(tmp_path / "pairs.jsonl", [
        good,
        {"src": ["q"], "tgt": [], "response": [["same"], ["same"]], "sort": [1, 0]},
        {"src": ["q"], "tgt": [], "response": [["a"], ["b"]], "sort": [1, 1]},
        {"src": ["q"], "tgt": [], "response": [[""], ["b"]], "sort": [1, 0]},
        {"src": ["word " * 200], "tgt": [], "response": [["a"], ["b"]], "sort": [1, 0]},
    ])
    code, out, err = run_cli(capsys, "validate", dpo_recipe(tmp_path, tiny_own_dir, data={"train": [str(data)], "max_length": 64}))
    assert code == 0, err
    assert "5 records" in out and "1 pair in 1 row" in out  # (it said "1 pairs in 1 rows")
    for reason in ("1 empty response", "1 identical chosen and rejected", "1 prompt longer than max_length", "1 tied sort"):
        assert reason in out


def test_bad_preference_data_is_one_line_error(tmp_path, capsys, tiny_own_dir):
    bad = _write(tmp_path / "bad.jsonl", [{"src": ["q"], "tgt": [], "response": [["a"], ["b"]], "sort": [1, 0]}, {"src": ["q"], "tgt": [], "sort": [1, 0]}])
    code, _, err = run_cli(capsys, "train", dpo_recipe(tmp_path, tiny_own_dir, data={"train": [str(bad)], "max_length": 64}))
    assert code == 2 and f"{bad}:2:" in err and "response" in err and len(err.strip().splitlines()) == 1
    none = _write(tmp_path / "none.jsonl", [{"src": ["q"], "tgt": [], "response": [["a"], ["a"]], "sort": [1, 0]}])
    code, _, err = run_cli(capsys, "train", dpo_recipe(tmp_path, tiny_own_dir, data={"train": [str(none)], "max_length": 64}))
    assert code == 2 and "no trainable preference pairs left after filtering (1 identical chosen and rejected)" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("precompute", [False, True])
def test_first_step_loss_is_log2_with_live_or_precomputed_reference(tmp_path, capsys, tiny_own_dir, precompute):
    """At step 1 the policy is the reference, so the sigmoid loss is exactly log 2 only if the reference
    log-probs line up with the policy's pair by pair (a misordered precompute would not give log 2)."""
    recipe = dpo_recipe(tmp_path, tiny_own_dir, lora=False, max_steps=2, logging_steps=1, learning_rate=1e-5,
                        precompute_ref_log_probs=precompute)
    code, out, err = run_cli(capsys, "train", recipe)
    assert code == 0, err
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    first = next(h for h in history if "loss" in h)
    assert abs(first["loss"] - 0.693147) < 1e-4
    assert first["tokens_per_second"] > 0 and 0 < first["packing_efficiency"] <= 1
