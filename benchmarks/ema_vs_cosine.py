"""Weight EMA at a constant rate against a cosine-decayed rate (`train.ema`, docs/recipes.md "Weight EMA"): a
mechanism check on a tiny random model, not a statement about ERNIE 4.5 (no real weights on any machine here).

    python benchmarks/ema_vs_cosine.py [--out benchmarks/results-ema_vs_cosine.txt] [--steps 200] [--seeds 0,1,2]

The model: `erniekit-lite tiny` dense (hidden 64, 2 layers) with the real ERNIE 4.5 tokenizer, seed 0. The data:
LLaMA-Factory's English alpaca demo (`alpaca_en_demo.json`, 999 records), the first 90% trained, the last 10% held
out. Each seed trains SFT LoRA (r 8, alpha 16) twice on the same rows in the same order, so on the same tokens:
  - cosine:    learning rate 5e-3, 20 warm-up steps, cosine decay to 0;
  - ema:       learning rate 5e-3, 20 warm-up steps, then constant, with `train.ema: {decay: 0.98, start: 20}`;
and the held-out loss (`erniekit-lite eval RUN --data held-out`) is measured for cosine's final adapter, the
constant-rate run's final adapter and its EMA (`RUN/ema`). Losses are deterministic (seeded, fp32, CPU): one run per
seed, not a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("ERNIEKIT_SHARED", str(ROOT.parent / "shared")))
WARMUP = 20  # steps: the rate's warm-up, and the EMA's start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results-ema_vs_cosine.txt"))
    p.add_argument("--steps", type=int, default=200, help="optimizer steps of each run")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--decay", type=float, default=0.98)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import yaml

    from erniekit_lite.cli import main as cli
    from erniekit_lite.evaluate import evaluate
    from erniekit_lite.tiny import write_tiny

    start = time.time()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="ema-vs-cosine-") as tmp:
        tmp = Path(tmp)
        base = write_tiny(str(tmp / "base"), "dense", str(SHARED / "ernie45" / "ernie-4.5-0.3b-base-pt"), hidden_size=64, layers=2, seed=0)
        records = json.loads((SHARED / "data" / "llamafactory" / "alpaca_en_demo.json").read_text(encoding="utf-8"))
        cut = len(records) * 9 // 10
        train, held_out = tmp / "train.json", tmp / "held_out.json"
        train.write_text(json.dumps(records[:cut], ensure_ascii=False), encoding="utf-8")
        held_out.write_text(json.dumps(records[cut:], ensure_ascii=False), encoding="utf-8")
        schedules = {
            "cosine": {"lr_scheduler_type": "cosine"},
            "ema": {"lr_scheduler_type": "constant_with_warmup", "ema": {"decay": args.decay, "start": WARMUP}},
        }
        for seed in seeds:
            for name, schedule in schedules.items():
                out = tmp / f"{name}-{seed}"
                recipe = {
                    "model": {"path": str(base), "dtype": "float32"},
                    "method": "sft",
                    "data": {"train": [{"path": str(train), "format": "alpaca"}], "max_length": 512},
                    "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
                    "output": {"dir": str(out)},
                    "train": {"learning_rate": 5e-3, "warmup_steps": WARMUP, "max_steps": args.steps, "per_device_train_batch_size": 2,
                              "activation_checkpointing": False, "logging_steps": 20, "save_strategy": "no", "seed": seed, **schedule},
                }
                (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
                assert cli(["train", str(tmp / "r.yaml")]) == 0
                targets = {"cosine": out} if name == "cosine" else {"constant": out, "constant + ema": out / "ema"}
                for label, target in targets.items():
                    loss = evaluate(str(target), str(held_out), out=str(tmp / f"eval-{label}-{seed}.json"), log=lambda *a: None)["eval_loss"]
                    results.setdefault(label, []).append(loss)
                    rows.append(f"| {seed} | {label} | {loss:.4f} |")
    wall = time.time() - start
    lines = [f"# Weight EMA at a constant rate vs cosine decay, tiny dense ERNIE 4.5 (hidden 64, 2 layers, real tokenizer), "
             f"SFT LoRA r 8, lr 5e-3, {args.steps} steps, batch 2 packed rows of 512, alpaca demo 90/10, EMA decay {args.decay} from step {WARMUP}",
             "", "| seed | weights | held-out loss |", "| --- | --- | ---: |", *rows, "",
             "| weights | mean held-out loss over seeds | per seed |", "| --- | ---: | --- |"]
    for label, losses in results.items():
        lines.append(f"| {label} | {statistics.mean(losses):.4f} | {', '.join(f'{x:.4f}' for x in losses)} |")
    lines += ["", "A mechanism check on a tiny random model: it says the EMA is computed, saved and evaluated as a run; it is "
              "no figure for ERNIE 4.5, for which none exists here.",
              f"(steps {args.steps}, seeds {args.seeds}, decay {args.decay}; wall {wall:.0f} s; the footer below is the runner's)"]
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
