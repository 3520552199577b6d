"""`distributed.sequence_parallel: 2` on CPU: real tokens per second of rows split over 2 gloo processes beside one
process holding each row, so the cost of the all-to-alls is on record until a GPU measures it. A mechanism check
on a tiny random model, not a forecast for a GPU.

    python benchmarks/sequence_parallel.py [--lengths 4096,8192] [--steps 4] [--rounds 3]

Each run: `erniekit-lite train` of the tiny dense model (hidden 256, 4 layers, 8 attention heads and 4 key/value
heads, the project's own tokenizer), LoRA r 8 on every linear layer, fp32, no activation checkpointing, one packed
row of LENGTH tokens per step (samples of 700-1,500 tokens, so rows hold several and samples straddle the cut),
STEPS steps. Modes:
- one: one process, torch's own thread count (every core);
- one-1-thread: one process, one thread (what each split process has: torch's launcher sets OMP_NUM_THREADS=1);
- split-2: `--num-processes 2`, `distributed.sequence_parallel=2`: each process holds half of every row.
tokens/s: the run's real tokens over the Trainer's train_runtime (its first step included), median and range over
the rounds; the modes of a length alternate within a round.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "one": ([], {}),
    "one-1-thread": ([], {"OMP_NUM_THREADS": "1"}),
    "split-2": (["distributed.sequence_parallel=2", "--num-processes", "2"], {}),
}


def write_data(path: Path, samples: int) -> None:
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog model token answer question hello name tiny".split()
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(samples):
            q = " ".join(rng.choices(words, k=rng.randint(50, 150)))
            a = " ".join(rng.choices(words, k=rng.randint(600, 1300)))
            f.write(json.dumps({"src": [q], "tgt": [a]}) + "\n")


def run(tmp: Path, model: Path, data: Path, length: int, steps: int, mode: str, index: int) -> dict:
    extra, env = MODES[mode]
    recipe = {"model": {"path": str(model), "dtype": "float32"}, "data": {"train": [str(data)], "max_length": length},
              "lora": {"r": 8, "alpha": 16, "dropout": 0.0}, "output": {"dir": str(tmp / "unused"), "sample_prompts": []},
              "train": {"max_steps": steps, "per_device_train_batch_size": 1, "logging_steps": 1, "save_steps": 10_000,
                        "activation_checkpointing": False, "bf16": False, "seed": 0}}
    path = tmp / f"{mode}-{length}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp / f"{mode}-{length}-{index}"
    done = subprocess.run([sys.executable, "-m", "erniekit_lite", "train", str(path), f"output.dir={out}", *extra],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HOME": str(tmp / "hf"), **env})
    if done.returncode:
        raise SystemExit(f"{mode} at {length}: {done.stderr[-2000:]}")
    results = json.loads((out / "train_results.json").read_text())
    return {"tokens": results["train_tokens"], "runtime": results["train_runtime"],
            "tokens_per_second": results["train_tokens"] / results["train_runtime"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from erniekit_lite.tiny import write_tiny

    lengths = [int(x) for x in args.lengths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = write_tiny(str(tmp / "tiny"), "dense", None, hidden_size=256, layers=4)
        config = json.loads((model / "config.json").read_text())
        data = tmp / "long.jsonl"
        write_data(data, 8 * args.steps * max(lengths) // 1000)
        runs = {(length, mode): [] for length in lengths for mode in MODES}
        for index in range(args.rounds):
            for length in lengths:
                for mode in MODES:
                    runs[length, mode].append(run(tmp, model, data, length, args.steps, mode, index))
    print(f"tiny dense model: hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
          f"{config['num_attention_heads']} attention heads, {config['num_key_value_heads']} key/value heads; LoRA r 8; "
          f"fp32; {args.steps} steps of one packed row; {args.rounds} rounds")
    print(f"{'row':>6}  {'mode':<13} {'real tokens/s (median [range])':<32} {'tokens':>7}  vs one")
    for length in lengths:
        base = statistics.median(r["tokens_per_second"] for r in runs[length, "one"])
        for mode in MODES:
            rates = [r["tokens_per_second"] for r in runs[length, mode]]
            tokens = {r["tokens"] for r in runs[length, mode]}
            print(f"{length:>6}  {mode:<13} {statistics.median(rates):>8.0f} [{min(rates):.0f}-{max(rates):.0f}]"
                  f"{'':<14} {'/'.join(map(str, sorted(tokens))):>7}  {statistics.median(rates) / base:.2f}x")
    print(json.dumps({"benchmark": "sequence_parallel", "runs": {f"{length}/{mode}": v for (length, mode), v in runs.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
