"""How long a mistake that needs no model takes to be answered: wall seconds from starting `erniekit-lite` to its
one-line refusal, each in a fresh process, `--runs` times (after one untimed warm-up, so the OS file cache holds the
packages, as for a user's second command). The target (issue 75): at most 3 s on these machines, idle.

    python benchmarks/mistakes.py [--runs 3]

The mistakes, on the tiny models `erniekit-lite tiny` writes: a data-path typo and a model-path typo (validate), a
folder holding another run (train), a `distributed.sequence_parallel` that does not divide the heads and a record
naming a missing image (validate).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = 3.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="erniekit-mistakes-") as tmp:
        work = Path(tmp)

        def cli(*command: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "erniekit_lite", *command], cwd=work, capture_output=True, text=True,
                                  env={**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"})

        shutil.copytree(ROOT / "recipes", work / "recipes")
        cli("tiny", "runs/tiny-ernie", "--arch", "dense")
        cli("tiny", "runs/tiny-ernie-vl", "--arch", "vl")
        (work / "runs" / "other").mkdir()
        (work / "runs" / "other" / "recipe.yaml").write_text((work / "recipes" / "quickstart.yaml").read_text())
        record = {"messages": [{"role": "user", "content": "<image>What colour?"}, {"role": "assistant", "content": "Red."}],
                  "images": ["colours/missing.png"]}
        (work / "recipes" / "data" / "missing_image.jsonl").write_text(json.dumps(record) + "\n")
        mistakes = {
            "data-path typo (validate)": ("validate", "recipes/quickstart.yaml", "data.train=[recipes/data/identiy.jsonl]"),
            "model-path typo (validate)": ("validate", "recipes/quickstart.yaml", "model.path=runs/tiny-erni"),
            "folder holding another run (train)": ("train", "recipes/quickstart.yaml", "output.dir=runs/other"),
            "sequence_parallel not dividing the heads (validate)": ("validate", "recipes/quickstart.yaml",
                                                                     "distributed.sequence_parallel=3"),
            "a record naming a missing image (validate)": ("validate", "recipes/quickstart-vl.yaml",
                                                           "data.train=[recipes/data/missing_image.jsonl]"),
        }
        rows = []
        for name, command in mistakes.items():
            said = cli(*command)  # warm-up, and what it says
            assert said.returncode == 2, (name, said.stderr[-2000:])
            times = []
            for _ in range(args.runs):
                started = time.perf_counter()
                cli(*command)
                times.append(time.perf_counter() - started)
            rows.append((name, times, said.stderr.strip().splitlines()[-1]))
    print(f"# mistakes needing no model: seconds to the one-line answer, {args.runs} runs each after a warm-up (target <= {TARGET:g} s)")
    print("| mistake | seconds, min / median / max | within target | the answer |")
    print("| --- | ---: | --- | --- |")
    for name, times, answer in rows:
        median = statistics.median(times)
        print(f"| {name} | {min(times):.2f} / **{median:.2f}** / {max(times):.2f} | {'yes' if median <= TARGET else 'no'} | "
              f"{answer[:140]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
