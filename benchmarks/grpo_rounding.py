"""How far float32 rounding alone moves the GRPO run that tests/test_grpo_processes.py compares across process
counts, so that test's tolerances are set by the arithmetic, not by one machine.

    python benchmarks/grpo_rounding.py [--out benchmarks/results-grpo_rounding.txt] [--rounds 3]

The test's one-process run (tiny dense ERNIE 4.5 with the real tokenizer, LoRA r 4, 3 plain-SGD steps at learning
rate 20, the seeded stand-in generator) is made once as it is and `--rounds` times with each initial adapter weight
moved by one float32 rounding step (x (1 +- 2^-24), a random sign per weight, seeds 1..N): any change in the sum
order of any reduction (DDP's all-reduce against local accumulation) is a difference of that size. Then the test's
2-process DDP run (accumulation 1 against 2). For each: the saved adapters' relative difference from the plain run
(all tensors, and lora_A / lora_B apart) and the relative difference of the logits the run scores on the test's row.
Deterministic (seeded, fp32, CPU, one thread): one run each, not a timing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).resolve().parent)]
SHARED = Path(os.environ.get("ERNIEKIT_SHARED", str(ROOT.parent / "shared")))

DRIVER = """
import sys
import grpo_stand_in
from erniekit_lite.cli import main
from erniekit_lite.train.grpo_trainer import ErnieGRPOTrainer
ErnieGRPOTrainer._generate_single_turn = grpo_stand_in.generate
sys.exit(main(['train', sys.argv[1]]))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results-grpo_rounding.txt"))
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    import test_grpo_processes as t
    from _common import git_revision, machine
    from erniekit_lite.cli import main as cli
    from erniekit_lite.tiny import write_tiny
    from erniekit_lite.train.grpo_trainer import ErnieGRPOTrainer
    from helpers import run_logits

    torch.set_num_threads(1)  # as the test (and each launched worker: OMP_NUM_THREADS=1)
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="grpo-rounding-"))
    tokenizer = tmp / "tokenizer"
    AutoTokenizer.from_pretrained(SHARED / "ernie45" / "ernie-4.5-0.3b-base-pt").save_pretrained(tokenizer)
    model_dir = Path(write_tiny(str(tmp / "tiny-dense"), "dense", str(tokenizer), hidden_size=64, layers=2))
    (tmp / "grpo_stand_in.py").write_text(t.STAND_IN)
    spec = importlib.util.spec_from_file_location("grpo_stand_in", tmp / "grpo_stand_in.py")
    stand_in = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stand_in)
    ErnieGRPOTrainer._generate_single_turn = stand_in.generate

    init, perturb = ErnieGRPOTrainer.__init__, {"seed": None}

    def perturbed_init(self, *a, **k):  # the adapters as built, each weight moved by one rounding step
        init(self, *a, **k)
        if perturb["seed"] is not None:
            g = torch.Generator().manual_seed(perturb["seed"])
            with torch.no_grad():
                for param in (q for q in self.model.parameters() if q.requires_grad):
                    param.mul_(1 + (torch.randint(0, 2, param.shape, generator=g).to(param.dtype) * 2 - 1) * 2.0**-24)

    ErnieGRPOTrainer.__init__ = perturbed_init
    runs = {}
    for seed in [None, *range(1, args.rounds + 1)]:
        perturb["seed"] = seed
        name = "one" if seed is None else f"one-rounded-{seed}"
        assert cli(["train", str(t.compared_run(tmp, name, model_dir, 2))]) == 0
        runs[name] = tmp / name
    ErnieGRPOTrainer.__init__ = init

    (tmp / "driver.py").write_text(DRIVER)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "true", "HF_HOME": str(tmp / "hf"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(tmp / "driver.py"),
                           str(t.compared_run(tmp, "two", model_dir, 1))], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs["two"] = tmp / "two"

    adapters = {n: load_file(str(d / "adapter_model.safetensors")) for n, d in runs.items()}
    logits = {n: run_logits(d) for n, d in runs.items()}
    rows = []
    for name in [n for n in runs if n != "one"]:
        part = lambda run, kind: {k: v for k, v in adapters[run].items() if kind in k}
        rows.append({"run": name, "adapter": t.relative(adapters[name], adapters["one"]),
                     "lora_A": t.relative(part(name, "lora_A"), part("one", "lora_A")),
                     "lora_B": t.relative(part(name, "lora_B"), part("one", "lora_B")),
                     "logits": float((logits[name] - logits["one"]).norm() / logits["one"].norm())})
    wall, load_end = time.perf_counter() - start, os.getloadavg()[0]

    lines = ["# grpo_rounding: tests/test_grpo_processes.py's compared run, against itself with the initial adapter moved by one float32 rounding step, and against 2 processes",
             f"# git {git_revision()}, machine {json.dumps(machine())}, torch {torch.__version__}",
             f"# wall {wall:.0f} s; 1-min load average {load_start:.2f} at start, {load_end:.2f} at end (deterministic: the load changes no figure)",
             "", "| run vs the 1-process run | adapters (all) | lora_A | lora_B | logits |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['run']} | {r['adapter']:.2e} | {r['lora_A']:.2e} | {r['lora_B']:.2e} | {r['logits']:.2e} |" for r in rows]
    rounded = [r for r in rows if r["run"].startswith("one-rounded")]
    lines += ["", f"One rounding step of the initial adapter moves the adapters by up to {max(r['adapter'] for r in rounded):.2e} and the logits by "
              f"up to {max(r['logits'] for r in rounded):.2e} (relative) after the same 3 steps.", "", json.dumps({"rows": rows})]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
