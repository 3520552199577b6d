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
import torch
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
    # with a weight EMA: agreed over the processes at each save (ema.py), so it resumes exactly too
    "local_sgd_3": ("distributed.sync=local_sgd", "distributed.sync_every=3", "train.ema={decay: 0.5, start: 1}"),
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
    if mode == "local_sgd_3":
        from safetensors.torch import load_file

        assert "ema.safetensors" in files
        name = next(p.name for p in (out / "ema").glob("*.safetensors"))
        ema, reference = load_file(out / "ema" / name), load_file(runs.dirs[mode] / "ema" / name)
        assert ema.keys() == reference.keys() and all(torch.equal(ema[k], reference[k]) for k in ema)


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
    assert "parameters" in __import__("torch").load(out / f"checkpoint-{stop}" / "sync-rank1.pt", weights_only=True)
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
            "in more than one process (DDP); memory: ") in out
    assert "of error feedback kept (every gradient's size) and the gradient bucket cloned each step" in out
    code, out, _ = run_cli(capsys, "validate", recipe)
    assert code == 0 and "sync:" not in out  # every_step, the default, is DDP as it is
    for overrides, says in [
        (["distributed.sync=gzip"], "distributed.sync: 'gzip' is not one of every_step, bf16, powersgd, local_sgd"),
        (["distributed.sync=bf16", "distributed.sync_every=4"], "sync_every is for sync: local_sgd (this recipe has sync: bf16)"),
        (["distributed.sync=powersgd", "distributed.powersgd_rank=0"], "powersgd_rank: expected a whole number >= 1 (got 0)"),
        (["distributed.sync=local_sgd", "distributed.sync_every=2"], "distributed.sync_every 2: train.save_steps (3) must be a multiple of it"),
        (["distributed.sync=local_sgd", "distributed.sync_every=3", "train.save_strategy=epoch"], "local_sgd saves on sync points, which save_strategy epoch"),
        (["distributed.sync=local_sgd", "distributed.sync_every=3", "train.eval_strategy=steps", "train.eval_steps=2"],
         "distributed.sync_every 3: train.eval_steps (2) must be a multiple of it, so every evaluation sees the averaged model"),
        (["distributed.sync=local_sgd", "distributed.sync_every=3", "train.eval_strategy=epoch"], "local_sgd evaluates on sync points"),
        (["distributed.sync=powersgd", "train.ddp_bucket_cap_mb=25"], "train.ddp_bucket_cap_mb: distributed.sync powersgd runs DDP with one gradient bucket"),
        (["distributed.sync=powersgd", "train.ddp_find_unused_parameters=true"], "train.ddp_find_unused_parameters: distributed.sync powersgd"),
    ]:
        code, _, err = run_cli(capsys, "validate", recipe, *overrides)
        assert code == 2 and err.count("\n") == 1 and says in err, err


def test_a_single_process_is_told(capsys):
    """A stand-in trainer (only what `setup` reads): one process says there is nothing to synchronise and registers
    nothing. (FSDP and DeepSpeed are refused by the run plan: test_cli's sharded-launch test.)"""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from erniekit_lite.recipe import DistributedSection
    from erniekit_lite.train.sync import setup

    plan = SimpleNamespace(sync=DistributedSection(sync="local_sgd", sync_every=2))  # the run plan's field
    said = []
    single = SimpleNamespace(accelerator=SimpleNamespace(distributed_type=DistributedType.NO))
    assert setup(single, plan, said.append) is None and not hasattr(single, "sync")
    assert said == [said[0]] and said[0].endswith(": one process, nothing to synchronise")


def _agreeing(rank: int, port: int, results: str) -> None:
    """One of 2 gloo processes running local SGD's step order by hand (a stand-in for the Trainer's loop: each
    process's own update, the EMA callback, then the averaging every 2 steps, as the callbacks are registered), with
    the project's WeightEma and sync.average; and the divergence guard of a stand-in trainer under local SGD."""
    import json
    import os
    import types

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    from erniekit_lite.train import checkpoints
    from erniekit_lite.train.ema import WeightEma
    from erniekit_lite.train.sync import average

    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 2)
    ema = WeightEma(decay=0.5, start=1)
    ema.across = True
    ema.attach(model)
    params = list(model.parameters())
    reference = None  # the EMA of the processes' mean parameters, computed on the side
    for step in range(1, 8):
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn_like(p))  # each process's own step
        ema.on_step_end(None, types.SimpleNamespace(global_step=step), None)
        mean = [p.detach().clone() for p in params]
        average(mean)
        reference = mean if step <= 1 else [0.5 * r + 0.5 * m for r, m in zip(reference, mean)]
        if step % 2 == 0:
            average(params)  # local SGD's averaging
    own = [e.clone() for e in ema.ema]
    ema.agree()
    result = {"agreed": max((e - r).abs().max().item() for e, r in zip(ema.ema, reference)),
              "own": max((e - r).abs().max().item() for e, r in zip(own, reference))}

    # the guard: a non-finite norm noted on rank 1 only (fused AdamW skips that step on the device) stops both
    guard = checkpoints.DivergenceGuard()
    guard.noted = torch.tensor([5.0, float("inf"), 2.5]) if rank else torch.zeros(3)
    try:
        guard.check(apart=True)  # local SGD
        result["stopped"] = None
    except checkpoints.Diverged as e:
        result["stopped"] = [e.step, e.grad_norm, e.loss]
    (Path(results) / f"{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def test_under_local_sgd_the_ema_is_the_averaged_models_and_a_divergence_stops_every_process(tmp_path):
    """With local SGD each process's EMA followed its own path, and only rank 0's was saved; agreed at each save, it is
    the EMA of the processes' mean parameters (within 1e-6) on both, where rank 0's own was not. A non-finite gradient
    norm noted on one process stops both at that step (the other would wait in the next collective)."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(_agreeing, (port, str(tmp_path)), nprocs=2, start_method="spawn")
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    for r in results:
        assert r["agreed"] <= 1e-6 and r["own"] > 1e-2, r
        assert r["stopped"] == [5, float("inf"), 2.5], r


class _RunsCode:
    """Pickled, it calls `open(marker, "w")` when unpickled: any code a crafted checkpoint file could run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _powersgd_stand_in(monkeypatch):
    """`Synchronised` under powersgd on rank 0, around the project's PowerSgd on a stand-in DDP (a Linear module)."""
    from types import SimpleNamespace

    from erniekit_lite.train import sync

    monkeypatch.setattr(sync.dist, "get_rank", lambda: 0)
    ddp = SimpleNamespace(module=torch.nn.Linear(4, 3), register_comm_hook=lambda state, hook: None)
    synced = sync.Synchronised(None, SimpleNamespace(sync="powersgd"))
    synced.powersgd = sync.PowerSgd(ddp, 2)
    return synced


def test_powersgd_state_is_saved_as_tensors_and_numbers_and_resumes(tmp_path, monkeypatch):
    """sync-rank0.pt loads with `weights_only=True` (PowerSGD's numpy random state as its key tensor and numbers), and
    a fresh PowerSgd loaded from it goes on with the same random draws, step count and per-parameter state."""
    saving = _powersgd_stand_in(monkeypatch)
    saving.powersgd.state.rng.randn(3)  # an odd count: a Gaussian is cached
    saving.powersgd.state.iter = 5
    saving.powersgd.carried = {"weight": (torch.randn(12), torch.randn(4, 2)), "bias": (torch.randn(3), None)}
    saving.save(tmp_path)
    plain = torch.load(tmp_path / "sync-rank0.pt", weights_only=True)
    assert plain["state"]["iter"] == 5
    loading = _powersgd_stand_in(monkeypatch)
    loading.load(tmp_path)
    assert loading.powersgd.state.iter == 5
    assert loading.powersgd.state.rng.randn(5).tolist() == saving.powersgd.state.rng.randn(5).tolist()
    assert loading.powersgd.carried.keys() == {"weight", "bias"} and loading.powersgd.carried["bias"][1] is None
    for name, (error, q) in saving.powersgd.carried.items():
        assert torch.equal(loading.powersgd.carried[name][0], error)
        assert q is None or torch.equal(loading.powersgd.carried[name][1], q)


def test_a_sync_file_that_would_run_code_is_refused_in_one_line(tmp_path, monkeypatch):
    """A sync-rank file holding more than tensors and plain numbers (here a pickled call that writes a marker file,
    as a downloaded checkpoint could hold) is not unpickled: resuming stops with one line naming it."""
    from erniekit_lite.errors import UserError

    marker = tmp_path / "ran"
    file = tmp_path / "sync-rank0.pt"
    torch.save({"state": {"iter": _RunsCode(str(marker))}, "by_parameter": {}}, file)
    with pytest.raises(UserError) as refused:
        _powersgd_stand_in(monkeypatch).load(tmp_path)
    assert not marker.exists()
    said = str(refused.value)
    assert said.startswith(f"{file}: refused") and "\n" not in said and "distributed.sync: every_step" in said
