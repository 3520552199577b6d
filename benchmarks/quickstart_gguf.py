"""From the quick start to a GGUF, as docs/after-training.md's block runs it (installation and the one-time tokenizer
download excluded): `erniekit-lite tiny` with the real sentencepiece tokenizer, the quick start trained on it, and
`erniekit-lite export --to gguf` through llama.cpp's converter named by a path relative to the working folder (as a
user types it). Each round in a fresh directory; min / median / max per step and in all.

    python benchmarks/quickstart_gguf.py [--rounds 3] [--llama-cpp DIR] [--tokenizer DIR] [--out FILE]

DIR defaults: $LLAMA_CPP_DIR (a llama.cpp checkout or the unpacked llama-cpp-python sdist), and the shared ERNIE 4.5
0.3B tokenizer (../shared, or $ERNIEKIT_SHARED) standing in for `--tokenizer baidu/ERNIE-4.5-0.3B-PT` offline.
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
SHARED = Path(os.environ.get("ERNIEKIT_SHARED", ROOT.parent / "shared"))
STEPS = ("tiny", "train", "export")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_DIR"))
    p.add_argument("--tokenizer", default=str(SHARED / "ernie45" / "ernie-4.5-0.3b-base-pt"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results-quickstart_gguf.txt"), help="results file")
    args = p.parse_args()
    if not args.llama_cpp:
        sys.exit("quickstart_gguf: needs llama.cpp's converter: --llama-cpp DIR or LLAMA_CPP_DIR")
    times: dict[str, list[float]] = {step: [] for step in (*STEPS, "all")}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="erniekit-quickstart-gguf-") as tmp:
            shutil.copytree(ROOT / "recipes", Path(tmp) / "recipes")
            llama = os.path.relpath(Path(args.llama_cpp).resolve(), tmp)  # relative, as a user types one

            def cli(*command: str) -> float:
                started = time.perf_counter()
                subprocess.run([sys.executable, "-m", "erniekit_lite", *command], cwd=tmp, check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "TQDM_DISABLE": "1"})
                return time.perf_counter() - started

            took = [cli("tiny", "runs/tiny-ernie-spm", "--arch", "dense", "--tokenizer", args.tokenizer),
                    cli("train", "quickstart", "model.path=runs/tiny-ernie-spm", "output.dir=runs/quickstart-spm"),
                    cli("export", "runs/quickstart-spm", "--to", "gguf", "--out", "runs/quickstart-gguf", "--llama-cpp", llama)]
            assert (Path(tmp) / "runs" / "quickstart-gguf" / "model-f16.gguf").is_file()
            for step, seconds in zip(STEPS, took):
                times[step].append(seconds)
            times["all"].append(sum(took))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    lines = ["# from the quick start to a GGUF: tiny (real tokenizer) -> train quickstart -> export --to gguf (f16)",
             f"machine: {os.cpu_count()} cores ({cpu}); git {_common.git_revision()}; {args.rounds} rounds, each in a fresh directory"]
    for step, values in times.items():
        lines.append(f"{step} seconds: min {min(values):.1f} / median {statistics.median(values):.1f} / max {max(values):.1f}")
    lines.append("command: python benchmarks/quickstart_gguf.py")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
