"""The tables in docs/prune.md: a tiny ERNIE 4.5 MoE fine-tuned on one domain, pruned to K experts per layer by
`erniekit-lite prune`, and over a grid of depth × experts (`--report "layers=4,3,2 experts=8,6,4,3,2"`): its held-out
loss in that domain and in another; and the parameter count and bf16 size of the released ERNIE-4.5-21B-A3B shape at
each K (computed from its config, no weights).

    python benchmarks/prune_tiny.py [--out benchmarks/results-prune_tiny.txt] [--steps 200] [--samples 400]

The model: `erniekit-lite tiny --arch moe` with the real ERNIE 4.5 tokenizer (hidden 128, 4 layers: the first
dense, then 3 MoE layers of 8 experts, top-2, 2 shared), seed 0, LoRA-tuned (r 16, every expert; the router stays
as initialised) on the first 400 records of the English alpaca demo (LLaMA-Factory's `alpaca_en_demo.json`, 10% held
out by the recipe's `data.eval_split`). A full fine-tune at this learning rate collapsed the tiny model's routing onto
two experts per layer within 20 steps (pruning to 2 then changes nothing), which says nothing about pruning. `prune RUN --report`
measures routing on the run's training data; in-domain held-out = that split, the other domain = ERNIEKit's Chinese
`sft-eval.jsonl` (`--eval`). Losses are deterministic (seeded, fp32, CPU): one run, not a timing.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("ERNIEKIT_SHARED", str(ROOT.parent / "shared")))
GRID = "layers=4,3,2 experts=8,6,4,3,2"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results-prune_tiny.txt"))
    p.add_argument("--steps", type=int, default=200, help="LoRA fine-tuning steps before pruning")
    p.add_argument("--samples", type=int, default=400, help="alpaca records (10%% held out)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch
    import yaml

    from erniekit_lite.cli import main as cli
    from erniekit_lite.tiny import write_tiny

    start = time.time()
    with tempfile.TemporaryDirectory(prefix="prune-tiny-") as tmp:
        tmp = Path(tmp)
        base = write_tiny(str(tmp / "base"), "moe", str(SHARED / "ernie45" / "ernie-4.5-0.3b-base-pt"), hidden_size=128, layers=4, seed=0)
        recipe = {
            "model": {"path": str(base), "dtype": "float32"},
            "method": "sft",
            "data": {"train": [{"path": str(SHARED / "data" / "llamafactory" / "alpaca_en_demo.json"), "max_samples": args.samples}],
                     "eval_split": 0.1, "max_length": 512},
            "lora": {"r": 16, "alpha": 32},
            "output": {"dir": str(tmp / "run")},
            "train": {"learning_rate": 2e-3, "lr_scheduler_type": "cosine", "warmup_steps": 20, "max_steps": args.steps,
                      "per_device_train_batch_size": 4, "activation_checkpointing": False, "logging_steps": 50,
                      "save_strategy": "no", "seed": 0},
        }
        (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
        assert cli(["train", str(tmp / "r.yaml")]) == 0
        domains = [("alpaca (in domain: the run's held-out 10%)", []),
                   ("ERNIEKit sft-eval.jsonl (another domain: Chinese)", ["--eval", str(SHARED / "data" / "erniekit" / "sft-eval.jsonl")])]
        tables = []
        for i, (name, extra) in enumerate(domains):
            out = tmp / f"pruned-{i}"
            assert cli(["prune", str(tmp / "run"), "--experts", "4", "--out", str(out), "--report", GRID, *extra]) == 0
            tables.append((name, out.with_name(f"{out.name}.report.md").read_text().split("\n", 2)[2]))
        released = released_sizes(torch)

    lines = [(f"# erniekit-lite prune on a tiny ERNIE 4.5 MoE (hidden 128, 4 layers: 1 dense, 3 MoE of 8 experts, top-2, "
              f"real tokenizer), LoRA-tuned {args.steps} steps on {args.samples} alpaca demo records; routing and layer "
              f"influence measured on its training data; --report \"{GRID}\""),
             "# held-out loss = `eval --data`'s loss; deterministic (seeded fp32 CPU), one run", ""]
    for name, table in tables:
        lines += [f"## held out: {name}", "", table.strip(), ""]
    lines += ["## the released ERNIE-4.5-21B-A3B shape (from its config, no weights): size at K experts per layer", "",
              "| experts per layer | parameters | bf16 size |", "| --- | --- | --- |"]
    lines += [f"| {k}{' (released)' if k == 64 else ''} | {n:,} | {2 * n / 1e9:.1f} GB |" for k, n in released]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    import transformers

    lines += ["", f"command: python benchmarks/prune_tiny.py --steps {args.steps} --samples {args.samples}",
              (f"machine: {cpu}, {os.cpu_count()} cores; python {platform.python_version()}, torch {torch.__version__}, "
               f"transformers {transformers.__version__}; wall {time.time() - start:.0f} s")]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


def released_sizes(torch) -> list[tuple[int, int]]:
    """(K, parameters) of the 21B-A3B architecture with K routed experts per layer, built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = []
    for k in (64, 48, 32, 16, 8):
        config = AutoConfig.from_pretrained(SHARED / "ernie45" / "ernie-4.5-21b-a3b-pt")
        config.moe_num_experts = k
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        out.append((k, sum(p.numel() for p in model.parameters())))
    return out


if __name__ == "__main__":
    sys.exit(main())
