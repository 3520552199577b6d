"""The quick start's wall time: `erniekit-lite tiny runs/tiny-ernie --arch dense` then `erniekit-lite train
recipes/quickstart.yaml`, as the README's first command runs them (installation excluded), each round in a fresh
directory; then, timed apart, the DPO quick start `erniekit-lite train recipes/quickstart-dpo.yaml` on that tiny
model. Prints min / median / max over the rounds and writes benchmarks/results-quickstart.txt.

    python benchmarks/quickstart.py [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common  # benchmarks/ is the script's own directory, first on sys.path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results-quickstart.txt"), help="results file")
    args = p.parse_args()
    times, dpo_times = [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="erniekit-quickstart-") as tmp:
            shutil.copytree(ROOT / "recipes", Path(tmp) / "recipes")

            def cli(*command: str) -> None:
                subprocess.run([sys.executable, "-m", "erniekit_lite", *command], cwd=tmp, check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "TQDM_DISABLE": "1"})

            started = time.perf_counter()
            cli("tiny", "runs/tiny-ernie", "--arch", "dense")
            cli("train", "recipes/quickstart.yaml")
            times.append(time.perf_counter() - started)
            started = time.perf_counter()
            cli("train", "recipes/quickstart-dpo.yaml")
            dpo_times.append(time.perf_counter() - started)
    rev = _common.git_revision()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), platform.machine())
    lines = [
        "# quick start wall time: `erniekit-lite tiny runs/tiny-ernie --arch dense && erniekit-lite train recipes/quickstart.yaml`",
        f"machine: {os.cpu_count()} cores ({cpu}); git {rev}; {args.rounds} rounds, each in a fresh directory",
        f"seconds: min {min(times):.1f} / median {statistics.median(times):.1f} / max {max(times):.1f}",
        f"DPO quick start (`erniekit-lite train recipes/quickstart-dpo.yaml`, after the above) seconds: min {min(dpo_times):.1f} / "
        f"median {statistics.median(dpo_times):.1f} / max {max(dpo_times):.1f}",
        "command: python benchmarks/quickstart.py",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
