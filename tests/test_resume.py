"""Resuming continues exactly; checkpoints are whole or absent (SIGKILL mid-save); a NaN loss stops the run before
its step is applied; `save_total_limit` rotation keeps the newest checkpoint (and the best).

In-process runs stop "as if signalled" at a chosen step (the signal handling itself is tested in test_stop.py);
the mid-save kill needs a real process.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from erniekit_lite.cli import main
from erniekit_lite.train import callbacks, checkpoints
from helpers import write_recipe

ROOT = Path(__file__).resolve().parents[1]
IDENTITY = str(ROOT / "recipes" / "data" / "identity.jsonl")


# In-process runs on one thread, as the subprocesses (OMP_NUM_THREADS=1): several times faster on a busy 2-core machine
pytestmark = pytest.mark.usefixtures("one_thread")


def recipe_file(tmp_path: Path, model_dir: Path, name: str, lora: bool = True, **train) -> Path:
    # 18 records in 6 packed rows: 12 steps are 2 epochs; LoRA dropout, so the resumed RNG state matters
    train = {"learning_rate": 2e-3, "max_steps": 12, "per_device_train_batch_size": 1, "logging_steps": 1,
             "save_steps": 4, "activation_checkpointing": False, "seed": 0, "lr_scheduler_type": "cosine",
             "warmup_steps": 3, **train}
    return write_recipe(tmp_path / f"{name}.yaml", model_dir, train=train, out=tmp_path / name,
                        lora={"r": 4, "alpha": 8, "dropout": 0.1} if lora else None)


def dpo_recipe_file(tmp_path: Path, model_dir: Path, name: str, **train) -> Path:
    """LoRA DPO (with dropout) on the identity demo's pairs (helpers.PAIRS: 8 pairs in 2 packed rows), 12 steps as
    `recipe_file`'s: one row per step and no accumulation, so each step's logged reward metrics are its one batch's."""
    train = {"beta": 0.1, "learning_rate": 5e-3, "max_steps": 12, "per_device_train_batch_size": 1, "logging_steps": 1,
             "save_steps": 4, "activation_checkpointing": False, "seed": 0, "lr_scheduler_type": "cosine",
             "warmup_steps": 3, **train}
    return write_recipe(tmp_path / f"{name}.yaml", model_dir, method="dpo", train=train, out=tmp_path / name,
                        lora={"r": 4, "alpha": 8, "dropout": 0.1})


def history(out: Path) -> list[dict]:
    """Per-step training logs of a finished run (a resumed run's include those restored from its checkpoint)."""
    logs = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [{k: v for k, v in h.items() if k in ("step", "loss", "learning_rate", "grad_norm", "mean_token_accuracy", "num_tokens")}
            for h in logs if "loss" in h]


def logged_steps(out: Path) -> list[int]:
    lines = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]
    return [e["step"] for e in lines if e["event"] == "log" and "loss" in e]


def stop_at(monkeypatch, step: int) -> None:
    """Stop after `step` exactly as SIGTERM arriving during that step does."""
    original = callbacks.StopOnSignal.on_step_end

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == step:
            self.signal = signal.SIGTERM
        return original(self, args, state, control, **kwargs)

    monkeypatch.setattr(callbacks.StopOnSignal, "on_step_end", on_step_end)


def train(capsys, *argv) -> tuple[int, str, str]:
    code = main(["train", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


# LoRA: stopped mid-epoch (6 rows per epoch) between two periodic saves, resumed with --resume (the newest).
# Full: stopped at a periodic save, resumed from the one before by path: step 8's checkpoint is written again.
@pytest.mark.parametrize(("lora", "stop", "resumed_from"), [(True, 7, None), (False, 8, 4)], ids=["lora", "full"])
def test_resumed_run_equals_uninterrupted_run(tmp_path, capsys, monkeypatch, tiny_own_dir, lora, stop, resumed_from):
    code, _, err = train(capsys, recipe_file(tmp_path, tiny_own_dir, "reference", lora))
    assert code == 0, err
    reference = history(tmp_path / "reference")
    assert [h["step"] for h in reference] == list(range(1, 13))

    path, out = recipe_file(tmp_path, tiny_own_dir, "resumed", lora), tmp_path / "resumed"
    stop_at(monkeypatch, stop)
    code, _, err = train(capsys, path)
    assert code == 143 and f"stopped at step {stop} of 12" in err, err
    monkeypatch.undo()
    assert checkpoints.complete(out) == [out / "checkpoint-4", out / f"checkpoint-{stop}"]

    checkpoint = out / f"checkpoint-{resumed_from or stop}"
    how = "--resume" if resumed_from is None else f"train.resume_from_checkpoint={checkpoint}"
    import transformers.trainer

    warned = []
    monkeypatch.setattr(transformers.trainer.logger, "warning", lambda message, *a, **k: warned.append(str(message)))
    code, stdout, err = train(capsys, path, how)
    assert code == 0, err
    assert not [w for w in warned if "missing keys" in w]  # the tied LM head is not in a checkpoint, by design
    assert f"resuming from {checkpoint}" in stdout
    start = resumed_from or stop
    assert logged_steps(out) == list(range(1, stop + 1)) + list(range(start + 1, 13))  # after resuming: each step once
    resumed = history(out)
    assert [h["step"] for h in resumed] == list(range(1, 13))
    # Same batches (data order), dropout masks (RNG), learning rates (scheduler) and updates (optimizer moments)
    for ref, got in zip(reference[start:], resumed[start:]):
        assert got["learning_rate"] == pytest.approx(ref["learning_rate"], rel=1e-9), got["step"]
        for key in ("loss", "grad_norm", "mean_token_accuracy"):
            assert got[key] == pytest.approx(ref[key], rel=1e-6), (got["step"], key)
        assert got["num_tokens"] == ref["num_tokens"], got["step"]  # the token count goes on from the checkpoint


def test_a_resumed_run_reports_the_whole_run(tmp_path, capsys, monkeypatch, tiny_own_dir):
    """Logged every 5 steps, stopped at step 7 (its window of steps 6-7 not yet logged) and resumed: the log at step 10
    averages steps 6-10 as the uninterrupted run's does, and train_results.json's mean loss, real tokens, packing
    efficiency and samples are the whole run's (the totals ride in the checkpoint); the runtime is both calls'."""
    settings = {"logging_steps": 5, "save_steps": 100}
    code, _, err = train(capsys, recipe_file(tmp_path, tiny_own_dir, "reference", **settings))
    assert code == 0, err
    path, out = recipe_file(tmp_path, tiny_own_dir, "resumed", **settings), tmp_path / "resumed"
    stop_at(monkeypatch, 7)
    code, _, err = train(capsys, path)
    assert code == 143, err
    monkeypatch.undo()
    first = json.loads((out / "checkpoint-7" / "erniekit_totals.json").read_text())
    code, stdout, err = train(capsys, path, "--resume")
    assert code == 0, err
    reference, resumed = history(tmp_path / "reference"), history(out)
    assert [h["step"] for h in resumed] == [h["step"] for h in reference] == [5, 10]
    for ref, got in zip(reference, resumed):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6), got["step"]
    whole, alone = (json.loads((d / "train_results.json").read_text()) for d in (tmp_path / "reference", out))
    assert alone["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-6)
    for key in ("train_tokens", "packing_efficiency", "train_samples"):
        assert alone[key] == whole[key], key
    assert alone["train_runtime"] > first["runtime"] > 0
    assert f"done: loss {whole['train_loss']:.4f} (mean over the run" in stdout


def test_totals_kept_per_process_by_older_checkpoints_are_read_combined(tmp_path):
    """Checkpoints written before the totals were summed over the processes hold one file per process
    (`erniekit_totals-rank<N>.json`, each with its own unlogged window and tokens): all are read and combined as the
    one file holds them (the windows' mean, the tokens' sum, divided by the processes that count each row), so they
    resume with any process count; the one file wins where both are."""
    from erniekit_lite.train.step import TOTALS, read_totals

    common = {"loss_logged": 12.5, "last_logged": 5, "runtime": 30.0}
    for rank, (window, real, slots) in enumerate([(1.0, 100, 128), (3.0, 60, 128)]):
        per_rank = {**common, "loss_window": window, "real_tokens": real, "token_slots": slots}
        (tmp_path / f"erniekit_totals-rank{rank}.json").write_text(json.dumps(per_rank))
    assert read_totals(tmp_path) == {**common, "loss_window": 2.0, "real_tokens": 160, "token_slots": 256}
    assert read_totals(tmp_path, sequence_parallel=2) == {**common, "loss_window": 2.0, "real_tokens": 80, "token_slots": 128}
    one = {**common, "loss_window": 0.5, "real_tokens": 7, "token_slots": 8}
    (tmp_path / TOTALS).write_text(json.dumps(one))
    assert read_totals(tmp_path) == one
    (tmp_path / "none").mkdir()
    assert read_totals(tmp_path / "none") is None


FIXTURES = ROOT / "tests" / "fixtures" / "checkpoints"  # written by tests/fixtures/write_checkpoints.py


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_checkpoint_written_before_the_trainer_redesign_resumes_as_an_uninterrupted_run_goes_on(tmp_path, capsys, tiny_own_dir, lora):
    """tests/fixtures/checkpoints holds step 4 of this file's two runs, written at the commit its `written_at.json`
    names (before the project's own Trainer replaced TRL's). Resumed from by path into a new run dir, a run at today's
    code logs steps 1-12 as an uninterrupted one: the same learning rates (rel 1e-9) and token counts, losses, gradient
    norms and accuracies within rel 1e-4 (the fixture was computed on another CPU, whose float sums may differ in the
    last bits)."""
    code, _, err = train(capsys, recipe_file(tmp_path, tiny_own_dir, "reference", lora))
    assert code == 0, err
    reference = history(tmp_path / "reference")
    fixture = FIXTURES / ("lora" if lora else "full") / "checkpoint-4"
    code, stdout, err = train(capsys, recipe_file(tmp_path, tiny_own_dir, "resumed", lora), f"train.resume_from_checkpoint={fixture}")
    assert code == 0, err
    assert f"resuming from {fixture}" in stdout
    resumed = history(tmp_path / "resumed")
    assert [h["step"] for h in resumed] == [h["step"] for h in reference] == list(range(1, 13))
    for ref, got in zip(reference, resumed):
        assert got["learning_rate"] == pytest.approx(ref["learning_rate"], rel=1e-9), got["step"]
        for key in ("loss", "grad_norm", "mean_token_accuracy"):
            assert got[key] == pytest.approx(ref[key], rel=1e-4), (got["step"], key)
        assert got["num_tokens"] == ref["num_tokens"], got["step"]


# TRL's DPOTrainer logged these; today's DPO logs them under the same names (the old run also logged num_tokens)
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
               "logits/chosen", "logits/rejected")


def test_a_dpo_checkpoint_written_before_the_trainer_redesign_resumes_as_an_uninterrupted_run_goes_on(tmp_path, capsys, tiny_own_dir):
    """tests/fixtures/checkpoints/dpo-lora holds step 4 of `dpo_recipe_file`'s run, written when DPO ran on TRL's
    DPOTrainer (`written_at.json`'s commit). Resumed from by path into a new run dir, a run at today's code (the
    project's own Trainer and DPO loss) logs steps 1-12 as an uninterrupted one: the same learning rates (rel 1e-9),
    losses, gradient norms and reward metrics (under the same names) within rel 1e-4. One batch per logged step, so
    today's metrics pooled over the logging window are the old per-batch ones."""
    code, _, err = train(capsys, dpo_recipe_file(tmp_path, tiny_own_dir, "reference"))
    assert code == 0, err
    fixture = FIXTURES / "dpo-lora" / "checkpoint-4"
    code, stdout, err = train(capsys, dpo_recipe_file(tmp_path, tiny_own_dir, "resumed"), f"train.resume_from_checkpoint={fixture}")
    assert code == 0, err
    assert f"resuming from {fixture}" in stdout
    reference, resumed = ([h for h in json.loads((tmp_path / name / "trainer_state.json").read_text())["log_history"] if "loss" in h]
                          for name in ("reference", "resumed"))
    assert [h["step"] for h in resumed] == [h["step"] for h in reference] == list(range(1, 13))
    for ref, got in zip(reference, resumed):
        assert got["learning_rate"] == pytest.approx(ref["learning_rate"], rel=1e-9), got["step"]
        for key in ("loss", "grad_norm", *DPO_METRICS):
            assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (got["step"], key)


def test_resume_without_checkpoint_starts_fresh(tmp_path, capsys, tiny_own_dir):
    path, out = recipe_file(tmp_path, tiny_own_dir, "fresh", max_steps=2, save_steps=10), tmp_path / "fresh"
    code, stdout, err = train(capsys, path, "--resume")
    assert code == 0, err
    assert f"resume: no complete checkpoint in {out}; starting from scratch" in stdout
    assert logged_steps(out) == [1, 2]
    code, _, err = train(capsys, path, "--resume")
    assert code == 2 and err.strip() == (f"error: output.dir: {out} already holds a finished run of this recipe: there is nothing "
                                         "to resume (to train it longer, resume with a larger train.max_steps or train.num_train_epochs)")
    code, _, err = train(capsys, path, "train.resume_from_checkpoint=x", "--resume")
    assert code == 2 and "--resume and train.resume_from_checkpoint=... both given" in err


# Run in a real process: saving the checkpoint of step 8 stops (for the test to kill it) after the RNG states are
# written into the staging dir, i.e. after the weights, optimizer and scheduler and before trainer_state.json
SLOW_SAVE = """
import sys, time, transformers
from erniekit_lite.cli import main
original = transformers.Trainer._save_rng_state
def save_rng_state(self, output_dir):
    original(self, output_dir)
    if self.state.global_step == 8:
        time.sleep(600)
transformers.Trainer._save_rng_state = save_rng_state
sys.exit(main(sys.argv[1:]))
"""


def test_kill_during_save_keeps_previous_checkpoint_and_resume_skips_partial(tmp_path, capsys, tiny_own_dir):
    path, out = recipe_file(tmp_path, tiny_own_dir, "killed", save_total_limit=1), tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, "train", str(path)], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    partial = out / "tmp-checkpoint-8" / "checkpoint-8"
    deadline = time.time() + 120
    while not (partial / "rng_state.pth").is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    proc.kill()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, stderr[-3000:]
    assert {"adapter_model.safetensors", "optimizer.pt", "rng_state.pth"} <= {p.name for p in partial.iterdir()}

    # The partial save is not a checkpoint; the previous one is whole and loads
    assert not (out / "checkpoint-8").exists()
    assert checkpoints.complete(out) == [out / "checkpoint-4"]
    previous = out / "checkpoint-4"
    assert json.loads((previous / "trainer_state.json").read_text())["global_step"] == 4
    assert all(torch.isfinite(t).all() for t in load_file(previous / "adapter_model.safetensors").values())
    assert torch.load(previous / "optimizer.pt", weights_only=True)["state"]

    # output.overwrite (left in a recipe, say) never deletes the checkpoints a resume continues from
    code, stdout, err = train(capsys, path, "output.overwrite=true", "--resume")
    assert code == 0, err
    assert f"resuming from {previous}" in stdout and f"removed {out / 'tmp-checkpoint-8'}" in stdout
    assert [h["step"] for h in history(out)] == list(range(1, 13))
    assert logged_steps(out)[-8:] == list(range(5, 13))  # 5-8 again: step 8's checkpoint never existed
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-12"]  # leftover removed


def test_nan_loss_stops_before_the_step_and_keeps_last_checkpoint(tmp_path, capsys, tiny_own_dir):
    # An absurd learning rate: step 1's update is finite but so large that step 2's forward overflows
    path, out = recipe_file(tmp_path, tiny_own_dir, "nan", learning_rate=1e30, save_steps=1, warmup_steps=0), tmp_path / "nan"
    code, _, err = train(capsys, path)
    assert code == callbacks.DIVERGED == 3, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: training diverged at step 2 of 12: loss nan, gradient norm nan; the step was not applied"), last
    assert last.endswith(f"the last checkpoint, {out / 'checkpoint-1'}, is from before it")
    assert checkpoints.complete(out) == [out / "checkpoint-1"]
    assert not list(out.glob("tmp-*")) and not (out / "train_results.json").exists()
    assert all(torch.isfinite(t).all() for t in load_file(out / "checkpoint-1" / "adapter_model.safetensors").values())
    end = json.loads((out / "progress.jsonl").read_text().splitlines()[-1])
    assert end["event"] == "end" and end["status"] == "diverged" and end["checkpoint"] == str(out / "checkpoint-1")


@pytest.mark.parametrize("best", [False, True], ids=["newest", "newest-and-best"])
def test_save_total_limit_one_keeps_the_newest_checkpoint(tmp_path, capsys, monkeypatch, tiny_own_dir, best):
    settings = {"save_total_limit": 1, "save_steps": 2, "max_steps": 8}
    if best:  # "greater is better" on eval_loss makes step 2 the best: rotation must keep it and the newest
        settings.update(eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                        metric_for_best_model="eval_loss", greater_is_better=True)
    path, out = recipe_file(tmp_path, tiny_own_dir, "rotated", **settings), tmp_path / "rotated"
    if best:
        raw = yaml.safe_load(path.read_text())
        raw["data"]["eval"] = [IDENTITY]
        path.write_text(yaml.safe_dump(raw))
    kept = []
    rotate = checkpoints.rotate

    def recording_rotate(run_dir, limit, keep):
        rotate(run_dir, limit, keep)
        kept.append([p.name for p in checkpoints.complete(run_dir)])

    monkeypatch.setattr(checkpoints, "rotate", recording_rotate)
    code, _, err = train(capsys, path)
    assert code == 0, err
    if best:
        assert kept == [["checkpoint-2"], ["checkpoint-2", "checkpoint-4"], ["checkpoint-2", "checkpoint-6"], ["checkpoint-2", "checkpoint-8"]]
        state = json.loads((out / "trainer_state.json").read_text())
        assert state["best_model_checkpoint"] == str(out / "checkpoint-2")  # the renamed path, not the staging one
    else:
        assert kept == [["checkpoint-2"], ["checkpoint-4"], ["checkpoint-6"], ["checkpoint-8"]]
        assert checkpoints.complete(out) == [out / "checkpoint-8"]
    assert not list(out.glob("tmp-*"))
    assert math.isfinite(json.loads((out / "train_results.json").read_text())["train_loss"])


def test_a_finished_run_extended_with_more_steps_keeps_its_first_steps(tmp_path, capsys, tiny_own_dir):
    """`--resume train.max_steps=8` on a finished 4-step run: it ends at step 8, the first 4 steps' losses are those
    of the first run, the schedule change is said, and the step-4 checkpoint stays. Any other change is refused."""
    path, out = recipe_file(tmp_path, tiny_own_dir, "extend", max_steps=4, save_steps=4), tmp_path / "extend"
    code, _, err = train(capsys, path)
    assert code == 0, err
    first = history(out)
    assert [h["step"] for h in first] == [1, 2, 3, 4]

    code, _, err = train(capsys, path, "--resume", "train.learning_rate=1e-3")
    assert code == 2 and "train.learning_rate changed" in err and "may change only the schedule" in err
    code, stdout, err = train(capsys, path, "train.max_steps=8", "--resume")
    assert code == 0, err
    assert "resume: train.max_steps: 4 -> 8" in stdout and "model and metrics will be replaced" in stdout
    assert f"resuming from {out / 'checkpoint-4'}" in stdout
    extended = history(out)
    assert [h["step"] for h in extended] == list(range(1, 9))
    assert extended[:4] == first  # restored from the checkpoint, unchanged
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 8
    assert (out / "checkpoint-4").is_dir() and (out / "checkpoint-8").is_dir()
    assert yaml.safe_load((out / "recipe.yaml").read_text())["train"]["max_steps"] == 8

    code, _, err = train(capsys, path, "train.max_steps=8", "--resume")  # finished again: nothing more to do
    assert code == 2 and "nothing to resume" in err
