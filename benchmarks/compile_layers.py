"""Compiled decoder layers on CPU (issue 46): what compiling costs and what a step then takes, eager against inductor.

    python benchmarks/compile_layers.py [--rounds 3] [--steps 6]

What runs: `erniekit-lite train` on a tiny random ERNIE 4.5 (`erniekit_lite.tiny`, dense, hidden 128, 4 layers, the
project's own small tokenizer), LoRA r 8 on the 7 default targets, fp32, the identity demo data packed into rows of
up to 512 tokens, batch 1, no activation checkpointing, --steps optimizer steps logged every step; once eager and once
with `model.compile_layers: true` (backend inductor), each in its own process, interleaved over --rounds.

Metrics, from each run's own `trainer_state.json` log and wall clock:
- first step: the first logged step's wall time minus eager's (compiling happens there, and again for the first
  backward; on CPU inductor writes and builds C++), each run with an empty inductor cache (a cold compile);
- later steps: the median wall time per step over steps 3 to --steps (after the shapes went dynamic);
- the losses: equal within 1e-5 or the script says so.

This says nothing about a GPU: inductor's CPU code is not its CUDA code, and on 2 cores a tiny model's step is mostly
Python. It states the compile time the docs promise and checks the compiled run trains the same.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
from pathlib import Path
from transformers import TrainerCallback
from erniekit_lite.cli import main
from erniekit_lite.train import callbacks

stamps = []

class Stamp(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        stamps.append(time.perf_counter())

train = callbacks.train
def timed(trainer, out, resume=None):
    trainer.add_callback(Stamp())
    stamps.append(time.perf_counter())
    return train(trainer, out, resume)
callbacks.train = timed
assert main(["train", sys.argv[1]]) == 0
Path(sys.argv[2]).write_text(json.dumps([b - a for a, b in zip(stamps, stamps[1:])]))
"""


def run(tmp: Path, model: Path, name: str, steps: int, round_: int) -> dict:
    import yaml

    out = tmp / f"{name}-{round_}"
    recipe = {
        "model": {"path": str(model), "compile_layers": name == "compiled"},
        "method": "sft",
        "data": {"train": [str(ROOT / "recipes" / "data" / "identity.jsonl")], "max_length": 512},
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "output": {"dir": str(out), "sample_prompts": []},
        "train": {"max_steps": steps, "logging_steps": 1, "save_strategy": "no", "learning_rate": 1e-3,
                  "per_device_train_batch_size": 1, "activation_checkpointing": False, "seed": 0},
    }
    path = tmp / f"{name}-{round_}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    times = tmp / f"{name}-{round_}.json"
    # a fresh inductor cache per run: the compile time measured is a cold one, as on a new machine
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp / f"inductor-{name}-{round_}")}
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), str(times)], cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"compile_layers: the {name} run failed:\n{done.stderr[-3000:]}")
    losses = [h["loss"] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    return {"steps": json.loads(times.read_text()), "losses": losses}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from erniekit_lite.tiny import write_tiny

    print(__doc__.split("\n\n")[0])
    print(f"tiny dense ERNIE 4.5, hidden 128, 4 layers; LoRA r 8; fp32; rounds {args.rounds}; steps {args.steps}")
    results = {"eager": [], "compiled": []}
    with tempfile.TemporaryDirectory(prefix="compile-layers-") as tmp:
        tmp = Path(tmp)
        model = write_tiny(str(tmp / "model"), "dense", None, hidden_size=128, layers=4, seed=0)
        for r in range(args.rounds):
            for name in results:
                got = run(tmp, model, name, args.steps, r)
                results[name].append(got)
                later = statistics.median(got["steps"][2:])
                print(f"round {r + 1} {name}: first step {got['steps'][0]:.2f} s, later steps {later * 1000:.0f} ms (median)", flush=True)
    first = {n: statistics.median(g["steps"][0] for g in runs) for n, runs in results.items()}
    later = {n: statistics.median(statistics.median(g["steps"][2:]) for g in runs) for n, runs in results.items()}
    same = all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for c, e in zip(results["compiled"], results["eager"])
               for a, b in zip(c["losses"], e["losses"]))
    print("\n| run | first step, s (median) | later steps, ms (median) |")
    print("|---|---|---|")
    for n in results:
        print(f"| {n} | {first[n]:.2f} | {later[n] * 1000:.0f} |")
    print(f"\ncompiling (first step, compiled minus eager): {first['compiled'] - first['eager']:.1f} s")
    print(f"later steps, compiled / eager: {later['compiled'] / later['eager']:.2f}x")
    print(f"losses equal within 1e-5: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
