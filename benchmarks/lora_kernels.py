"""Work a training step launches, LoRA against full fine-tuning (issue 45): aten calls per optimizer step, counted.

    python benchmarks/lora_kernels.py [--rounds 3] [--steps 3]

What runs: `erniekit-lite train` on a tiny random ERNIE 4.5 (`erniekit_lite.tiny`, dense, hidden 128, 4 layers, the
project's own small tokenizer), the identity demo data packed into rows of up to 512 tokens, batch 1, bf16 autocast
(`train.bf16`), no activation checkpointing, fused AdamW, no logging step and no checkpoint in the counted steps:

- full: full fine-tuning on fp32 weights;
- lora-peft: LoRA r 8 (alpha 16, no dropout) on the 7 default targets of a bf16 base (`model.dtype: bfloat16`),
  through peft's own Linear forward (the fused path switched off);
- lora-fused: the same LoRA through `erniekit_lite.model.fused_lora` (what `train` does).

How: a torch dispatch mode counts every aten call during training, except those that launch no work: views and
aliases (`OpOverload.is_view`, and `_unsafe_view`), allocations (`empty`, `empty_strided`, `empty_like`) and the
profiler's markers. Runs of N and 2N optimizer
steps are counted and the difference divided by N, so set-up and the end of training cancel out. The counts are
exact (no timing): each round runs every configuration again, and the rounds agree or the script says so.

Target (issue 45): lora-fused <= 1.25x full.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_WORK = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::_unsafe_view"}  # allocations; a view by another name
CONFIGS = ("full", "lora-peft", "lora-fused")
TARGET = 1.25


def count_run(recipe: Path) -> collections.Counter:
    """aten calls that launch work during one `erniekit-lite train` of `recipe`, by op name."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from erniekit_lite.cli import main
    from erniekit_lite.train import callbacks

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            if not func.is_view and name not in NO_WORK and not name.startswith("profiler::"):
                self.calls[name] += 1
            return func(*args, **(kwargs or {}))

    counted, train = [], callbacks.train

    def counting(trainer, out, resume=None):
        with Calls() as calls:
            result = train(trainer, out, resume)
        counted.append(calls.calls)
        return result

    callbacks.train = counting
    try:
        if main(["train", str(recipe)]) != 0:
            raise SystemExit(f"lora_kernels: training {recipe} failed")
    finally:
        callbacks.train = train
    return counted[0]


def per_step(tmp: Path, model: Path, config: str, steps: int) -> collections.Counter:
    import yaml

    from erniekit_lite.model import fused_lora

    counts = []
    for n in (steps, 2 * steps):
        recipe = {
            "model": {"path": str(model), "dtype": "float32" if config == "full" else "bfloat16"},
            "method": "sft",
            "data": {"train": [str(ROOT / "recipes" / "data" / "identity.jsonl")], "max_length": 512},
            "output": {"dir": str(tmp / f"{config}-{n}"), "overwrite": True},
            "train": {"max_steps": n, "logging_steps": 1000, "save_strategy": "no", "learning_rate": 1e-4, "bf16": True,
                      "per_device_train_batch_size": 1, "activation_checkpointing": False, "seed": 0},
        }
        if config != "full":
            recipe["lora"] = {"r": 8, "alpha": 16, "dropout": 0.0}
        path = tmp / f"{config}-{n}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        fuse = fused_lora.fuse
        if config == "lora-peft":
            fused_lora.fuse = lambda model: (0, {})
        try:
            counts.append(count_run(path))
        finally:
            fused_lora.fuse = fuse
    few, many = counts
    return collections.Counter({k: (many[k] - few[k]) / steps for k in few.keys() | many.keys() if many[k] != few[k]})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="N: runs of N and 2N optimizer steps are counted")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import io
    from contextlib import redirect_stdout

    from erniekit_lite.tiny import write_tiny

    print(__doc__.split("\n\n")[0])
    print(f"tiny dense ERNIE 4.5, hidden 128, 4 layers; bf16 autocast; rounds {args.rounds}; N = {args.steps}")
    rounds: dict[str, list[collections.Counter]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="lora-kernels-") as tmp:
        tmp = Path(tmp)
        model = write_tiny(str(tmp / "model"), "dense", None, hidden_size=128, layers=4, seed=0)
        for r in range(args.rounds):
            for config in CONFIGS:
                with redirect_stdout(io.StringIO()):  # training's own lines
                    counts = per_step(tmp, model, config, args.steps)
                rounds[config].append(counts)
                print(f"round {r + 1} {config}: {sum(counts.values()):.1f} aten calls per optimizer step", flush=True)
    agree = all(all(c == runs[0] for c in runs) for runs in rounds.values())
    totals = {c: sum(runs[0].values()) for c, runs in rounds.items()}
    print("\n| configuration | aten calls per optimizer step | x full |")
    print("|---|---|---|")
    for config in CONFIGS:
        print(f"| {config} | {totals[config]:.1f} | {totals[config] / totals['full']:.2f} |")
    print(f"\nrounds agree: {'yes' if agree else 'NO (see the per-round lines)'}")
    ratio = totals["lora-fused"] / totals["full"]
    print(f"target lora-fused <= {TARGET}x full: {ratio:.2f}x, {'met' if ratio <= TARGET else 'NOT met'}")
    print("\nlargest differences, lora-fused minus full, by op (calls per step):")
    diff = {k: rounds["lora-fused"][0][k] - rounds["full"][0][k] for k in rounds["full"][0].keys() | rounds["lora-fused"][0].keys()}
    for name, d in sorted(((k, v) for k, v in diff.items() if v), key=lambda kv: -abs(kv[1]))[:12]:
        print(f"  {name}: {d:+.1f}")
    print("\nlargest differences, lora-peft minus lora-fused, by op (calls per step):")
    diff = {k: rounds["lora-peft"][0][k] - rounds["lora-fused"][0][k] for k in rounds["lora-peft"][0].keys() | rounds["lora-fused"][0].keys()}
    for name, d in sorted(((k, v) for k, v in diff.items() if v), key=lambda kv: -abs(kv[1]))[:12]:
        print(f"  {name}: {d:+.1f}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
