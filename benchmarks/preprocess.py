"""Data preprocessing speed: records/s to read, tokenize and pack, by process count, and `validate` on 100k records.

    python benchmarks/preprocess.py [--rounds 5] [--num-proc 1,2] [--large 100000] [--large-rounds 3] [--skip-validate]

What it measures
- Small: the alpaca demo (999 records, `../shared/data/llamafactory/alpaca_en_demo.json`) through
  `erniekit_lite.data.prepare.prepare` at max_length 2048 with packing: read the file, convert, tokenize with the
  real ERNIE 4.5 tokenizer, pack. The tokenizer is loaded once beforehand (not timed); the data cache is off, so
  every round does the full work. `--num-proc` values are interleaved over `--rounds` (1, 2, 1, 2, ...); the
  headline is the median records/s of each. Target (issue): >= 2,000 records/s on 2 cores.
- Large: `--large` records written to a temp file from the demo, each instruction suffixed with its index so no
  two records (and no two prompt texts) are equal: repetition would flatter any cache inside the tokenizer.
  `prepare` runs once with the data cache empty (tokenize + write the entry) and once more (read it back).
- `validate`: the real CLI, `erniekit-lite validate` in a fresh process on a recipe over the large file (a tiny
  random ERNIE 4.5 model with the real tokenizer, written to the temp dir), twice on a cache folder of its own:
  the first run tokenizes, the second reads the cache. Wall time as a user sees it, imports, tokenizer loading
  and the CLI's own settings (it turns the tokenizer's threads off: TOKENIZERS_PARALLELISM=false) included.

Output: a markdown table, then ONE final JSON line. Also printed: cores, thread counts and the 1-minute load
average before and after. CPU timings on a shared machine are noisy: trust runs that started near load 0, and
read the CPU seconds beside the wall seconds (a busy machine stretches wall time, much less CPU time).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "benchmarks"))
import _common as C  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shared", default=os.environ.get("ERNIEKIT_SHARED", str(ROOT.parent / "shared")),
                   help="shared reference files (default: $ERNIEKIT_SHARED or ../shared beside the repo)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per process count on the alpaca demo")
    p.add_argument("--num-proc", default="1,2", help="comma-separated data.num_proc values to compare")
    p.add_argument("--large", type=int, default=100_000, help="records in the large run (0: skip it)")
    p.add_argument("--large-rounds", type=int, default=3, help="rounds of the large run and of validate, each with an empty cache")
    p.add_argument("--skip-validate", action="store_true", help="do not time the `erniekit-lite validate` CLI")
    return p.parse_args(argv)


def cpu_seconds() -> float:
    """CPU time of this process (all its threads) and of its finished children (forked tokenizing workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed_prepare(data, tokenizer) -> tuple[float, float, object]:
    from erniekit_lite.data.prepare import prepare

    c0, t0 = cpu_seconds(), time.perf_counter()
    prepared = prepare(data, tokenizer, log=lambda *_: None)
    return time.perf_counter() - t0, cpu_seconds() - c0, prepared


def write_large(demo: Path, count: int, out: Path) -> None:
    records = json.loads(demo.read_text(encoding="utf-8"))
    unique = []
    for i in range(count):
        record = dict(records[i % len(records)])
        record["instruction"] = f"{record['instruction']} (#{i})"
        unique.append(record)
    out.write_text(json.dumps(unique, ensure_ascii=False), encoding="utf-8")


def run_validate(recipe: Path, cache_root: Path) -> tuple[float, str]:
    env = {**os.environ, "ERNIEKIT_CACHE": str(cache_root)}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "erniekit_lite", "validate", str(recipe)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"validate failed:\n{done.stdout}\n{done.stderr}")
    return wall, done.stdout


def main(argv=None) -> int:
    args = parse_args(argv)
    demo = C.demo_file(args.shared, "alpaca_en_demo.json")
    tok_dir = Path(args.shared) / C.TOKENIZER
    counts = [int(n) for n in args.num_proc.split(",")]
    load_start = os.getloadavg()[0]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    t_start = time.perf_counter()

    from transformers import AutoTokenizer

    import erniekit_lite
    from erniekit_lite.recipe import DataSection

    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    print(f"# preprocessing, alpaca demo + {args.large} unique alpaca records, real ERNIE 4.5 tokenizer; "
          f"{cores} cores, 1-min load {load_start:.2f}", flush=True)

    small = {n: [] for n in counts}
    data = DataSection(train=[{"path": str(demo), "format": "alpaca"}], max_length=2048, packing=True, cache=False)
    timed_prepare(data, tokenizer)  # warm-up: imports, first-call allocations
    for rnd in range(args.rounds):
        for n in counts:
            wall, cpu, prepared = timed_prepare(data.model_copy(update={"num_proc": n}), tokenizer)
            small[n].append((wall, cpu))
            print(f"round {rnd + 1} num_proc {n}: {len(prepared.train.samples)} records in {wall:.3f} s "
                  f"({len(prepared.train.samples) / wall:.0f} records/s, {cpu:.2f} CPU-s)", flush=True)
    records = len(prepared.train.samples)

    large, timings = {}, {"miss": [], "hit": [], "validate_first": [], "validate_second": []}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        if args.large:
            path = tmp / "alpaca-large.json"
            write_large(demo, args.large, path)
            big = DataSection(train=[{"path": str(path), "format": "alpaca"}], max_length=2048, packing=True)
            recipe = None
            if not args.skip_validate:
                from erniekit_lite.tiny import write_tiny

                model = write_tiny(str(tmp / "tiny"), "dense", str(tok_dir), hidden_size=64, layers=2)
                recipe = tmp / "recipe.yaml"
                recipe.write_text(json.dumps({  # JSON is YAML
                    "model": {"path": str(model), "dtype": "float32"}, "method": "sft",
                    "data": {"train": [{"path": str(path), "format": "alpaca"}], "max_length": 2048},
                    "output": {"dir": str(tmp / "run")}, "train": {"max_steps": 10},
                }))
            for rnd in range(args.large_rounds):
                os.environ["ERNIEKIT_CACHE"] = str(tmp / f"cache-{rnd}")  # empty: the first prepare misses
                for phase in ("miss", "hit"):
                    wall, cpu, prepared = timed_prepare(big, tokenizer)
                    timings[phase].append((wall, cpu))
                    print(f"round {rnd + 1} large {phase}: {args.large} records in {wall:.2f} s ({args.large / wall:.0f} "
                          f"records/s, {cpu:.1f} CPU-s), {len(prepared.train.rows)} rows", flush=True)
                if rnd == 0:
                    entry = next((tmp / "cache-0" / "data").glob("*.npz"))
                    large["cache_entry_mb"] = round(entry.stat().st_size / 2**20, 1)
                if recipe is not None:
                    for phase in ("first", "second"):  # a cache folder of its own: the first run misses
                        wall, out = run_validate(recipe, tmp / f"validate-cache-{rnd}")
                        reused = "data cache:" in out and "reused" in out
                        if reused != (phase == "second"):
                            raise SystemExit(f"validate, {phase} run: expected a cache {'hit' if phase == 'second' else 'miss'}")
                        timings[f"validate_{phase}"].append((wall, 0.0))
                        print(f"round {rnd + 1} validate, {phase} run (cache {'hit' if reused else 'miss'}): {wall:.2f} s", flush=True)
    for key, runs in timings.items():
        if runs:
            walls = sorted(w for w, _ in runs)
            large[key] = {"seconds": [round(min(walls), 2), round(statistics.median(walls), 2), round(max(walls), 2)],
                          "cpu_seconds_median": round(statistics.median(c for _, c in runs), 2)}
            if not key.startswith("validate"):
                large[key]["records_per_second_median"] = round(args.large / statistics.median(walls), 1)

    summary = {}
    for n, runs in small.items():
        walls = [w for w, _ in runs]
        summary[n] = {
            "median_seconds": round(statistics.median(walls), 3),
            "records_per_second": [round(records / max(walls), 1), round(records / statistics.median(walls), 1),
                                   round(records / min(walls), 1)],  # min / median / max
            "median_cpu_seconds": round(statistics.median(c for _, c in runs), 3),
        }
    load_end = os.getloadavg()[0]
    wall = time.perf_counter() - t_start

    print()
    print("| input | num_proc | rounds | seconds (median) | records/s, min / median / max | CPU-s (median) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for n, s in summary.items():
        lo, mid, hi = s["records_per_second"]
        print(f"| alpaca demo ({records}) | {n} | {args.rounds} | {s['median_seconds']:.3f} | {lo:.0f} / **{mid:.0f}** / {hi:.0f} | "
              f"{s['median_cpu_seconds']:.2f} |")
    for phase in ("miss", "hit"):
        if phase in large:
            s = large[phase]
            lo, mid, hi = (args.large / w for w in reversed(s["seconds"]))
            label = "first run (cache empty)" if phase == "miss" else "second run (cache hit)"
            print(f"| {args.large} unique, {label} | auto | {args.large_rounds} | {s['seconds'][1]:.2f} | "
                  f"{lo:.0f} / **{mid:.0f}** / {hi:.0f} | {s['cpu_seconds_median']:.1f} |")
    for phase in ("first", "second"):
        if f"validate_{phase}" in large:
            lo, mid, hi = large[f"validate_{phase}"]["seconds"]
            print(f"\n`erniekit-lite validate` on {args.large} records, {phase} run: {lo:.1f} / **{mid:.1f}** / {hi:.1f} s "
                  f"(min / median / max of {args.large_rounds})", end="")
    if "validate_first" in large:
        print(f"; cache entry {large['cache_entry_mb']} MB")
    best = max(s["records_per_second"][1] for s in summary.values())
    print(f"target >= 2,000 records/s on the alpaca demo: {'met' if best >= 2000 else 'NOT met'} ({best:.0f})")
    print(f"wall time: {wall:.1f} s; 1-min load average {load_start:.2f} at start, {load_end:.2f} at end"
          + (" (above 1: other processes may have competed; timings may be noisy)" if load_start > 1.0 else ""))
    print(json.dumps({
        "benchmark": "preprocess",
        "config": {"records": records, "rounds": args.rounds, "large_rounds": args.large_rounds, "num_proc": counts, "large": args.large, "cores": cores,
                   "erniekit_lite": erniekit_lite.__version__, "python": sys.version.split()[0]},
        "alpaca_demo": {str(n): s for n, s in summary.items()},
        "large": large,
        "targets_met": {"records_per_second_2000": best >= 2000},
        "wall_seconds": round(wall, 1),
        "loadavg_1min": [round(load_start, 2), round(load_end, 2)],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
