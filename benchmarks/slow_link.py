"""`distributed.sync` on a slow link: bytes sent per optimizer step, step time and held-out loss of each mode, on two
loopback "machines" in a network namespace of their own whose loopback is throttled with `tc ... tbf` (the issue's
Nebula-I setting, small). A mechanism check on a tiny random model, not a forecast for the 0.3B or the 21B-A3B.

    python benchmarks/slow_link.py [--rate 200mbit] [--steps 40] [--seeds 0,1,2]

Each run: two `erniekit-lite train --num-machines 2 --machine-rank R --main-process-ip 127.0.0.1` launchers, one
gloo process each (as tests/test_multinode.py runs them), the tiny dense model (hidden 128, 4 layers, the project's
own 640-token tokenizer: 869,504 parameters), the first 400 alpaca demo records (10% held out), max_length 128, 2
rows per process per step, AdamW, full fine-tuning and LoRA r 8 (all linear layers).

- bytes_per_step: the namespace's loopback tx bytes (`ip -s -j link`: both machines' sends) of a STEPS-step run
  minus those of an 8-step run (seed 0), over the difference in steps: what the steps send, without start-up
  (rendezvous, DDP's broadcast of the weights) and the final save;
- step_s: the Trainer's train_runtime / STEPS, median and range over the seeds, the link throttled to RATE;
- eval_loss: on the held-out 10% after the same STEPS steps (the same tokens), mean over the seeds, and its mean
  difference from every_step's at the same seed.
Modes: every_step, bf16, powersgd (rank 4), local_sgd (H = 8), and local_sgd at H = 1 (under plain SGD it equals
every_step exactly, tests/test_sync.py; here, with AdamW, each process's own moments make the measured difference).
Needs root (unshare -n, tc); run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("ERNIEKIT_SHARED", str(ROOT.parent / "shared")))
SHORT = 8  # steps of the run whose bytes are subtracted (a multiple of H)
MODES = {
    "every_step": [],
    "bf16": ["distributed.sync=bf16"],
    "powersgd": ["distributed.sync=powersgd", "distributed.powersgd_rank=4"],
    "local_sgd": ["distributed.sync=local_sgd", "distributed.sync_every=8"],
    "local_sgd_h1": ["distributed.sync=local_sgd", "distributed.sync_every=1"],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="200mbit", help="the loopback's rate (tc tbf)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # in the namespace already
    args = p.parse_args()
    if not args.inside:
        return subprocess.run(["unshare", "-n", sys.executable, __file__, *sys.argv[1:], "--inside"]).returncode
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", args.rate, "burst", "256kb", "latency", "100ms"], check=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="slow-link-") as tmp:
        tmp = Path(tmp)
        sys.path.insert(0, str(ROOT))
        from transformers.utils import logging as transformers_logging

        from erniekit_lite.tiny import write_tiny

        transformers_logging.disable_progress_bar()  # its save's bar would land in the results file

        model = write_tiny(str(tmp / "tiny"), "dense", None, hidden_size=128, layers=4)
        rows = []
        for method in ("full", "lora"):
            recipe = write_recipe(tmp, model, method)
            for mode, overrides in MODES.items():
                short = launch(tmp, recipe, overrides, SHORT, seeds[0])
                runs = [launch(tmp, recipe, overrides, args.steps, seed) for seed in seeds]
                per_step = (runs[0]["bytes"] - short["bytes"]) // (args.steps - SHORT)
                rows.append({"sync": mode, "method": method, "bytes_per_step": per_step,
                             "step_s": [r["train_runtime"] / args.steps for r in runs], "eval_loss": [r["eval_loss"] for r in runs]})
                print(f"# raw: {json.dumps(rows[-1])}", flush=True)
    print(f"# distributed.sync on two loopback machines (gloo), the loopback throttled to {args.rate} (tc tbf); the tiny dense "
          f"model (869,504 parameters), {args.steps} steps x 2 processes x 2 rows of max_length 128, AdamW; seeds {args.seeds}")
    print("# bytes_per_step: both machines' loopback tx bytes per optimizer step (a run of the steps minus one of "
          f"{SHORT}); step_s: train_runtime / steps, median (min-max); eval_loss: held-out 10%, mean over seeds, and the "
          "mean difference from every_step at the same seed")
    for method in ("full", "lora"):
        base = next(r for r in rows if r["method"] == method and r["sync"] == "every_step")
        print(f"\n## {'full fine-tuning' if method == 'full' else 'LoRA r 8'}")
        for r in (r for r in rows if r["method"] == method):
            diff = statistics.mean(a - b for a, b in zip(r["eval_loss"], base["eval_loss"]))
            times = r["step_s"]
            print(f"sync={r['sync']} bytes_per_step={r['bytes_per_step']} ({r['bytes_per_step'] / base['bytes_per_step']:.3f} of "
                  f"every_step) step_s={statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f}) "
                  f"eval_loss={statistics.mean(r['eval_loss']):.4f} vs_every_step={diff:+.4f}")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    import torch

    print(f"\nmachine: {cpu}, {os.cpu_count()} cores; torch {torch.__version__}; wall {time.time() - started:.0f} s")
    return 0


def write_recipe(tmp: Path, model: str, method: str) -> Path:
    import yaml

    recipe = {
        "model": {"path": str(model)},
        "data": {"train": [{"path": str(SHARED / "data" / "llamafactory" / "alpaca_en_demo.json"), "max_samples": 400}],
                 "eval_split": 0.1, "max_length": 128},
        "output": {"dir": str(tmp / "unused")},
        "train": {"learning_rate": 1e-3 if method == "full" else 2e-3, "per_device_train_batch_size": 2, "logging_steps": 8,
                  "save_strategy": "no", "activation_checkpointing": False, "lr_scheduler_type": "constant"},
    }
    if method == "lora":
        recipe["lora"] = {"r": 8, "alpha": 16}
    path = tmp / f"{method}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def tx_bytes() -> int:
    link = json.loads(subprocess.run(["ip", "-s", "-j", "link", "show", "dev", "lo"], capture_output=True, text=True, check=True).stdout)
    return link[0]["stats64"]["tx"]["bytes"]


def launch(tmp: Path, recipe: Path, overrides: list[str], steps: int, seed: int) -> dict:
    """One run on two loopback machines: its train_results.json and the loopback bytes it sent."""
    out = tmp / f"run-{len(list(tmp.glob('run-*')))}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp / "hf")}
    before = tx_bytes()
    machines = [subprocess.Popen([sys.executable, "-m", "erniekit_lite", "train", str(recipe), f"output.dir={out}",
                                  f"train.max_steps={steps}", f"train.seed={seed}", *overrides, "--num-machines", "2",
                                  "--machine-rank", str(rank), "--main-process-ip", "127.0.0.1", "--main-process-port",
                                  str(port), "--num-processes", "2"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = [m.communicate(timeout=1200)[0] for m in machines]
    sent = tx_bytes() - before
    if any(m.returncode for m in machines):
        raise SystemExit(f"run {out} failed:\n{logs[0][-3000:]}\n{logs[1][-3000:]}")
    return {**json.loads((out / "train_results.json").read_text()), "bytes": sent}


if __name__ == "__main__":
    sys.exit(main())
