"""SIGTERM / Ctrl-C during training: the step finishes, a checkpoint is saved, the run says how to go on and exits
128 + signal; progress.jsonl tells a watcher (the web UI) what happened; resuming from the checkpoint finishes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import write_recipe

ROOT = Path(__file__).resolve().parents[1]


def recipe(tmp_path: Path, model_dir: Path, steps: int) -> Path:
    train = {"learning_rate": 1e-3, "max_steps": steps, "per_device_train_batch_size": 1, "logging_steps": 1,
             "save_steps": 10_000, "activation_checkpointing": False, "seed": 0}
    return write_recipe(tmp_path / "recipe.yaml", model_dir, data={"max_length": 256}, lora={"r": 4, "alpha": 8}, train=train)


def events(out: Path) -> list[dict]:
    path = out / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_a_checkpoint_and_resume_finishes(tmp_path, tiny_own_dir, signum):
    path = recipe(tmp_path, tiny_own_dir, steps=30)
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "erniekit_lite", "train", str(path)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not [e for e in events(out) if e["event"] == "log"] and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr[-3000:]
    end = events(out)[-1]
    assert end["event"] == "end" and end["status"] == "stopped" and end["max_steps"] == 30
    checkpoint = Path(end["checkpoint"])
    assert checkpoint == out / f"checkpoint-{end['step']}" and end["step"] >= 1
    assert {"adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= {p.name for p in checkpoint.iterdir()}
    last_line = stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"stopped at step {end['step']} of 30: checkpoint saved in {checkpoint}")
    assert end["step"] < 30
    assert not (out / "train_results.json").exists()  # not mistaken for a finished run

    # the same recipe continues from the checkpoint and finishes
    resumed = subprocess.run([sys.executable, "-m", "erniekit_lite", "train", str(path), f"train.resume_from_checkpoint={checkpoint}"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    last = events(out)
    assert last[-1]["event"] == "end" and last[-1]["status"] == "finished" and last[-1]["step"] == 30
    resumed_steps = [e["step"] for e in last[last.index(end) + 1 :] if e["event"] == "log" and "loss" in e]
    assert resumed_steps == list(range(end["step"] + 1, 31))  # every remaining step once, none repeated
    assert (out / "train_results.json").is_file()


def test_a_signal_during_the_final_save_waits_for_it(tmp_path):
    """SIGTERM while the final model is written: the save completes, then the run stops with 143."""
    from types import SimpleNamespace

    from erniekit_lite.errors import Stopped
    from erniekit_lite.train import callbacks

    written = []

    class Trainer:  # the four calls save_final makes, the first interrupted by a real SIGTERM
        state = SimpleNamespace(is_world_process_zero=True, global_step=4, max_steps=4)

        def save_model(self, out):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs between bytecodes: give it the chance to kill us
            written.append("model")

        def save_metrics(self, split, metrics):
            written.append("metrics")

        def save_state(self):
            written.append("state")

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped) as stopped:
        callbacks.save_final(Trainer(), tmp_path, {})
    assert written == ["model", "metrics", "state"]
    assert stopped.value.code == 143 and "the trained model is complete" in str(stopped.value)
    assert json.loads((tmp_path / callbacks.PROGRESS).read_text().splitlines()[-1])["status"] == "finished"
    assert signal.getsignal(signal.SIGTERM) == before  # the usual handling is back
