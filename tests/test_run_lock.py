"""A run holds its output folder (train/run_lock.py): a second `train` into it is refused in one line naming the
holder's pid, before anything heavy loads and with the folder untouched; a killed holder blocks nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from helpers import run_cli, write_recipe

# A stand-in for a running `train`: it takes the run lock of the folder as `train` does, then sleeps
HOLDER = r"""
import sys, time
from erniekit_lite.train import run_lock
with run_lock.hold(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""
# `erniekit-lite train ...`, saying at the end whether torch had been imported
PROBE = r"""
import sys
from erniekit_lite.cli import main
code = main(sys.argv[1:])
print("torch imported" if "torch" in sys.modules else "torch not imported")
sys.exit(code)
"""


def hold(out: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def contents(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def test_a_second_train_into_a_held_folder_is_refused_and_a_killed_holder_blocks_nothing(tmp_path, capsys, tiny_own_dir):
    from erniekit_lite.recipe import load
    from erniekit_lite.train import rundir

    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_own_dir,
                          train={"max_steps": 2, "per_device_train_batch_size": 2, "logging_steps": 1, "save_steps": 2,
                                 "activation_checkpointing": False, "seed": 0})
    out = tmp_path / "out"
    out.mkdir()  # what the first run of this recipe has written by its first log
    (out / "recipe.yaml").write_text(rundir._identity(load(str(recipe), [])))
    (out / "progress.jsonl").write_text(json.dumps({"event": "start", "step": 0, "max_steps": 2}) + "\n"
                                        + json.dumps({"event": "log", "step": 1, "loss": 3.0}) + "\n")
    before = contents(out)
    holder = hold(out)
    try:
        refusal = (f"error: output.dir: {out} is in use by another run (pid {holder.pid}); wait until it ends, "
                   "or choose another output.dir\n")
        for launch in ([], ["--num-processes", "2"]):  # one process, or the launching command of several
            done = subprocess.run([sys.executable, "-c", PROBE, "train", str(recipe), *launch], capture_output=True,
                                  text=True, timeout=60)
            assert (done.returncode, done.stderr, done.stdout) == (2, refusal, "torch not imported\n")
        assert contents(out) == before
        assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock", "out", "recipe.yaml"]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the killed holder's lock file is still there; its lock went with it
    assert (tmp_path / ".out.lock").read_text().split()[0] == str(holder.pid)
    code, _, err = run_cli(capsys, "train", recipe)
    assert code == 0, err
    assert (out / "train_results.json").is_file()
    assert not (tmp_path / ".out.lock").exists()  # a run that ends removes it


def test_launched_processes_leave_the_lock_to_their_launcher(monkeypatch, tmp_path):
    from erniekit_lite.train import run_lock

    monkeypatch.delenv(run_lock.HELD, raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert run_lock.takes(None) and run_lock.takes(0) and not run_lock.takes(1)  # machine 0's command takes it
    with run_lock.hold(tmp_path / "out") as lock:
        assert os.environ[run_lock.HELD] == str(lock.path)  # what the launched processes inherit
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("RANK", "0")
        assert not run_lock.takes(None)
    assert run_lock.HELD not in os.environ
    assert run_lock.takes(None)  # rank 0 of a launcher of the user's own (torchrun) takes it
    monkeypatch.setenv("RANK", "1")
    assert not run_lock.takes(None)
