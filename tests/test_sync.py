"""`distributed.sync` (train/sync.py): two gloo processes on one box (`train --num-processes 2`), the tiny dense model
with the project's own tokenizer, SGD with momentum 0.9 and no clipping (so that the exact equalities below hold:
averaging parameters after a momentum step equals a step on averaged gradients, the momentum being linear too).

- local_sgd with H = 1 equals every_step (relative 1e-5: the same sums in another order);
- powersgd at rank 64 (no matrix of the tiny model shrinks at that rank, so every gradient goes as it is, with error
  feedback whose mean over the processes is zero) equals every_step (relative 1e-5);
- powersgd at rank 2, local_sgd at H = 3 and bf16 differ from every_step (each sends something else), and each,
  stopped at its checkpoint of step 3 and resumed in a new run dir, logs exactly the losses and gradient norms of
  the run that went on (PowerSGD's error feedback and warm start rebuilt for DDP's first-step buckets, then carried
  into its regrouped ones; local_sgd's per-process optimizer state).
Bytes sent and step times on a throttled link: benchmarks/slow_link.py (docs/distributed.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from test_distributed import train_cli, write_data

STEPS = 6


def losses_and_norms(out: Path) -> dict[int, tuple[float, float]]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {h["step"]: (h["loss"], h["grad_norm"]) for h in history if "loss" in h}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, tiny_own_dir) -> Path:
    tmp = tmp_path_factory.mktemp("sync")
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_own_dir)},
        "data": {"train": [str(write_data(tmp / "data.jsonl"))], "max_length": 64, "packing": True},
        "output": {"dir": str(tmp / "unused")},
        "train": {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 0.05, "max_grad_norm": 0,
                  "max_steps": STEPS, "per_device_train_batch_size": 1, "activation_checkpointing": False,
                  "logging_steps": 1, "save_steps": 3, "seed": 0},
    }))
    return path


@pytest.fixture(scope="module")
def runs(recipe, tmp_path_factory):
    """Each mode's run (launched once for the module), by name."""
    made = {}

    def run(name: str, *overrides: str) -> dict[int, tuple[float, float]]:
        if name not in made:
            out = tmp_path_factory.mktemp("sync-runs") / name
            done = train_cli(out.parent, str(recipe), f"output.dir={out}", *overrides, "--num-processes", "2")
            assert done.returncode == 0, done.stderr[-4000:]
            made[name] = out
        return losses_and_norms(made[name])

    run.dirs = made
    return run


MODES = {
    "every_step": (),
    "local_sgd_1": ("distributed.sync=local_sgd", "distributed.sync_every=1"),
    "powersgd_full": ("distributed.sync=powersgd", "distributed.powersgd_rank=64"),
    "powersgd_2": ("distributed.sync=powersgd", "distributed.powersgd_rank=2"),
    "local_sgd_3": ("distributed.sync=local_sgd", "distributed.sync_every=3"),
    "bf16": ("distributed.sync=bf16",),
}


@pytest.mark.slow  # two launches each (~12 s apiece on 2 cores)
@pytest.mark.parametrize("exact", ["local_sgd_1", "powersgd_full"])
def test_modes_that_send_the_same_mean_equal_every_step(runs, exact):
    every, other = runs("every_step", *MODES["every_step"]), runs(exact, *MODES[exact])
    assert sorted(other) == list(range(1, STEPS + 1))
    for step in every:
        assert other[step][0] == pytest.approx(every[step][0], rel=1e-5), step
    if exact == "powersgd_full":  # every process's gradient norm is the mean's
        assert [other[s][1] for s in every] == pytest.approx([every[s][1] for s in every], rel=1e-5)


@pytest.mark.slow  # two launches each
@pytest.mark.parametrize("mode", ["powersgd_2", "local_sgd_3", "bf16"])
def test_each_mode_resumes_exactly(runs, recipe, tmp_path, mode):
    whole, every = runs(mode, *MODES[mode]), runs("every_step", *MODES["every_step"])
    differs_from = 3 if mode == "powersgd_2" else 1  # PowerSGD compresses from the third step
    assert all(whole[s] == every[s] for s in range(1, differs_from))
    assert whole[differs_from] != every[differs_from]  # (loss, gradient norm): the norm is of what was sent
    checkpoint = runs.dirs[mode] / "checkpoint-3"
    files = {p.name for p in checkpoint.iterdir()}
    assert ({"sync-rank0.pt", "sync-rank1.pt"} <= files) == (mode != "bf16")
    out = tmp_path / "resumed"
    done = train_cli(tmp_path, str(recipe), f"output.dir={out}", *MODES[mode], f"train.resume_from_checkpoint={checkpoint}",
                     "--num-processes", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    resumed = losses_and_norms(out)  # steps 1-3 from the checkpoint's history, 4-6 trained after the resume
    assert {s: resumed[s] for s in (4, 5, 6)} == {s: whole[s] for s in (4, 5, 6)}  # exactly: the same floats


@pytest.mark.slow  # three launches, ~45 s
def test_local_sgd_stopped_between_averagings_resumes_exactly(recipe, tmp_path):
    """SIGTERM while the processes hold different parameters (no averaging until step 40): the stop's checkpoint
    holds each process's own trained parameters beside its optimizer state, and `--resume` continues as the run that
    was never stopped."""
    import signal
    import subprocess
    import sys
    import time

    from test_distributed import ROOT, events

    overrides = ["distributed.sync=local_sgd", "distributed.sync_every=40", "train.max_steps=40", "train.save_steps=40"]
    whole = tmp_path / "whole"
    done = train_cli(tmp_path, str(recipe), f"output.dir={whole}", *overrides, "--num-processes", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    out = tmp_path / "stopped"
    command = [sys.executable, "-m", "erniekit_lite", "train", str(recipe), f"output.dir={out}", *overrides, "--num-processes", "2"]
    env = {**__import__("os").environ, "CUDA_VISIBLE_DEVICES": "", "HF_HOME": str(tmp_path / "hf")}
    launcher = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not any(e["event"] == "log" and e["step"] >= 2 for e in events(out)):
        assert time.time() < deadline and launcher.poll() is None, "no step 2 in time"
        time.sleep(0.02)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 143, err[-3000:]
    stop = events(out)[-1]["step"]
    assert 2 <= stop < 40
    assert "parameters" in __import__("torch").load(out / f"checkpoint-{stop}" / "sync-rank1.pt", weights_only=False)
    done = train_cli(tmp_path, str(recipe), f"output.dir={out}", *overrides, "--resume", "--num-processes", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    resumed, expected = losses_and_norms(out), losses_and_norms(whole)
    assert {s: resumed[s] for s in range(stop + 1, 41)} == {s: expected[s] for s in range(stop + 1, 41)}


def test_validate_shows_the_choice_and_bad_settings_are_one_line(tmp_path, capsys, recipe):
    from helpers import run_cli

    code, out, err = run_cli(capsys, "validate", recipe, "distributed.sync=powersgd")
    assert code == 0, err
    assert ("sync: powersgd rank 4 (each gradient matrix sent as rank-4 factors with error feedback, from the third step; "
            "vectors and matrices the factors would not shrink are all-reduced as they are); applies when training runs "
            "in more than one process (DDP)") in out
    code, out, _ = run_cli(capsys, "validate", recipe)
    assert code == 0 and "sync:" not in out  # every_step, the default, is DDP as it is
    for overrides, says in [
        (["distributed.sync=gzip"], "distributed.sync: Input should be 'every_step', 'bf16', 'powersgd' or 'local_sgd'"),
        (["distributed.sync=bf16", "distributed.sync_every=4"], "sync_every is for sync: local_sgd (this recipe has sync: bf16)"),
        (["distributed.sync=powersgd", "distributed.powersgd_rank=0"], "powersgd_rank: expected a whole number >= 1 (got 0)"),
        (["distributed.sync=local_sgd", "distributed.sync_every=2"], "distributed.sync_every 2: train.save_steps (3) must be a multiple of it"),
        (["distributed.sync=local_sgd", "distributed.sync_every=3", "train.save_strategy=epoch"], "local_sgd saves on sync points, which save_strategy epoch"),
        (["distributed.sync=powersgd", "train.ddp_bucket_cap_mb=25"], "train.ddp_bucket_cap_mb: distributed.sync powersgd runs DDP with one gradient bucket"),
        (["distributed.sync=powersgd", "train.ddp_find_unused_parameters=true"], "train.ddp_find_unused_parameters: distributed.sync powersgd"),
    ]:
        code, _, err = run_cli(capsys, "validate", recipe, *overrides)
        assert code == 2 and err.count("\n") == 1 and says in err, err


def test_sharded_runs_and_single_processes_are_told(capsys):
    """A stand-in trainer (only what `setup` reads): FSDP and DeepSpeed refuse a sync mode in one line; one process
    says there is nothing to synchronise and registers nothing."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from erniekit_lite.errors import UserError
    from erniekit_lite.recipe import DistributedSection
    from erniekit_lite.train.sync import setup

    recipe = SimpleNamespace(distributed=DistributedSection(sync="local_sgd", sync_every=2))
    for kind in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        trainer = SimpleNamespace(accelerator=SimpleNamespace(distributed_type=kind))
        with pytest.raises(UserError, match=f"^distributed.sync: local_sgd changes how DDP synchronises, and this run shards with {kind.value}"):
            setup(trainer, recipe)
    said = []
    single = SimpleNamespace(accelerator=SimpleNamespace(distributed_type=DistributedType.NO))
    assert setup(single, recipe, said.append) is None and not hasattr(single, "sync")
    assert said == [said[0]] and said[0].endswith(": one process, nothing to synchronise")
