"""The quick start on CPU, idle and beside another CPU-bound job, by torch's thread setting (issue 63, point 1).

    python benchmarks/threads.py [--rounds 3] [--settings default,torch,1,2]

What runs: the README's quick start (`erniekit-lite train quickstart` on `erniekit-lite tiny`'s model, 30 steps), each
run its own process, timed from start to exit (wall) and by its `train_runtime`. Settings: `default` (whatever
erniekit-lite does when nothing is set: OpenMP's passive wait, `cli.passive_cpu_threads`), `torch` (torch's own
threads as they are: torch imported before the CLI sets anything, so OpenMP never reads that setting), `1` and `2`
(OMP_NUM_THREADS, with the default passive wait). Loads: `idle`, and `loaded`: one CPU-bound process per core (a Python
busy loop) running for the whole measurement. Settings and loads interleaved, `--rounds` times; the table gives
min / median / max wall seconds and the median train_runtime, and each loaded median over the same setting's idle one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {"default": {}, "torch": {}, "1": {"OMP_NUM_THREADS": "1"}, "2": {"OMP_NUM_THREADS": "2"}}
# `torch`: the CLI run in a process that imported torch first (OpenMP reads its environment when torch loads)
TORCH_FIRST = "import sys, torch; from erniekit_lite.cli import main; sys.exit(main(sys.argv[1:]))"


def run_once(work: Path, setting: str, n: int) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.update(ENV[setting])
    out = work / f"run-{setting}-{n}"
    started = time.perf_counter()
    entry = ["-c", TORCH_FIRST] if setting == "torch" else ["-m", "erniekit_lite"]
    done = subprocess.run([sys.executable, *entry, "train", "quickstart", f"output.dir={out}"],
                          cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{setting}: exit {done.returncode}: {done.stderr[-2000:]}")
    return wall, json.loads((out / "train_results.json").read_text())["train_runtime"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settings", default=",".join(ENV))
    args = p.parse_args(argv)
    settings = args.settings.split(",")
    cores = os.cpu_count() or 1
    load_start = os.getloadavg()[0]
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="erniekit-threads-") as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-m", "erniekit_lite", "tiny", "runs/tiny-ernie", "--arch", "dense"], cwd=work, check=True,
                       capture_output=True)
        n = 0
        for rnd in range(args.rounds):
            for load in ("idle", "loaded"):
                busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)] if load == "loaded" else []
                try:
                    for setting in settings:
                        n += 1
                        wall, runtime = run_once(work, setting, n)
                        results.setdefault((load, setting), []).append((wall, runtime))
                        print(f"round {rnd + 1} {load} {setting}: wall {wall:.1f} s, train_runtime {runtime:.1f} s", flush=True)
                finally:
                    for b in busy:
                        b.kill()
                        b.wait()
    cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True, text=True).stdout.strip()
    print(f"\nquick start (30 steps, tiny dense model), {args.rounds} rounds; machine: {cores} cores ({cpu}); "
          f"1-min load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end (the loaded runs add {cores} busy processes)")
    print("| load | setting | wall s min / median / max | train_runtime s (median) | loaded / idle (wall, median) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for (load, setting), runs in results.items():
        walls = sorted(w for w, _ in runs)
        idle = statistics.median(w for w, _ in results[("idle", setting)])
        print(f"| {load} | {setting} | {walls[0]:.1f} / {statistics.median(walls):.1f} / {walls[-1]:.1f} | "
              f"{statistics.median(r for _, r in runs):.1f} | {statistics.median(walls) / idle:.2f}x |")
    print(json.dumps({"benchmark": "threads", "rounds": args.rounds, "cores": cores,
                      "runs": {f"{load} {setting}": runs for (load, setting), runs in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
