"""CLI start time: wall seconds from launching `erniekit-lite --help` to its exit.

    python benchmarks/cli_start.py [--runs 10]

What it measures
- Each command runs `--runs` times in a fresh process (after one untimed warm-up, so the OS file cache holds the
  interpreter and packages, as it does for a user's second command). Reported: min / median / max wall seconds.
- Commands: `erniekit-lite --help` (the installed console script, if on PATH beside this Python), the same through
  `python -m erniekit_lite --help`, `erniekit-lite validate --help`, and bare `python -c pass` as the floor an
  interpreter start costs on this machine.
- Also which heavy modules (torch, transformers, datasets, trl, numpy) `--help` imported: none should be, since
  handlers import them lazily.

Target (issue): < 0.5 s for `--help`. Output: a markdown table, then ONE final JSON line with the 1-minute load
average before and after (a busy machine slows process start too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "datasets", "trl", "numpy", "peft", "gradio")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="timed runs per command")
    return p.parse_args(argv)


def time_command(cmd: list[str], runs: int) -> list[float]:
    subprocess.run(cmd, cwd=ROOT, capture_output=True, check=True)  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, capture_output=True, check=True)
        times.append(time.perf_counter() - t0)
    return times


def heavy_imports() -> list[str]:
    probe = (
        "import sys, contextlib, io\n"
        "from erniekit_lite.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: main(['--help'])\n"
        "    except SystemExit: pass\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    return [m for m in out.split(",") if m]


def main(argv=None) -> int:
    args = parse_args(argv)
    load_start = os.getloadavg()[0]
    script = Path(sys.executable).with_name("erniekit-lite")
    commands = {"python -c pass (floor)": [sys.executable, "-c", "pass"]}
    if script.is_file():
        commands["erniekit-lite --help"] = [str(script), "--help"]
    commands["python -m erniekit_lite --help"] = [sys.executable, "-m", "erniekit_lite", "--help"]
    commands["erniekit-lite validate --help"] = (
        [str(script), "validate", "--help"] if script.is_file() else [sys.executable, "-m", "erniekit_lite", "validate", "--help"]
    )
    results = {}
    for name, cmd in commands.items():
        times = time_command(cmd, args.runs)
        results[name] = {"min_seconds": round(min(times), 4), "median_seconds": round(statistics.median(times), 4),
                         "max_seconds": round(max(times), 4)}
    heavy = heavy_imports()
    load_end = os.getloadavg()[0]

    print(f"# CLI start, {args.runs} runs each after a warm-up (min / median / max); Python {sys.version.split()[0]}")
    print()
    print("| command | seconds, min / median / max |")
    print("| --- | ---: |")
    for name, r in results.items():
        print(f"| `{name}` | {r['min_seconds']:.3f} / **{r['median_seconds']:.3f}** / {r['max_seconds']:.3f} |")
    print()
    headline = results.get("erniekit-lite --help", results["python -m erniekit_lite --help"])["median_seconds"]
    print(f"--help median {headline:.3f} s (target < 0.5 s: {'met' if headline < 0.5 else 'NOT met'}); "
          f"heavy modules imported by --help: {', '.join(heavy) or 'none'}")
    print(f"1-min load average {load_start:.2f} at start, {load_end:.2f} at end"
          + (" (above 1: other processes may have competed; timings may be noisy)" if load_start > 1.0 else ""))
    print(json.dumps({
        "benchmark": "cli_start",
        "config": {"runs": args.runs, "python": sys.version.split()[0]},
        "commands": results,
        "help_median_seconds": headline,
        "heavy_imports_on_help": heavy,
        "targets_met": {"help_under_0.5s": headline < 0.5},
        "loadavg_1min": [round(load_start, 2), round(load_end, 2)],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
