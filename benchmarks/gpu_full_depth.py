"""ERNIE-4.5-21B-A3B at its full released depth on one GPU: the shipped recipes' memory and speed, measured (issue 43).

    python benchmarks/gpu_check.py --prepare-assets gpu-assets          # here: tokenizer, configs, data (shared)
    python benchmarks/gpu_full_depth.py --assets gpu-assets             # on the GPU machine: <= 9 min on an H200
    python benchmarks/gpu_full_depth.py --smoke                         # the same code on CPU, a tiny 2-layer cut

No machine here can download the real weights, so the check makes them: random bf16 weights at the released config,
all 28 layers (`gpu_check.write_model`, initialized on the GPU), written as a safetensors checkpoint (~41 GiB: the
GPU machine's disk is 64 GiB, so no run saves a checkpoint). Each recipe then runs the product path in its own
child process (`erniekit_lite.train.sft.run` / `dpo.run`, through `erniekit_lite.model.load.load_model`, 4-bit
quantization of the base and the routed experts included), under its own time cap, and the results file is
rewritten after each section, so one slow part cannot take the others' figures:

0. weights: the checkpoint written (seconds, bytes).
1. `sft-qlora-24gb.yaml` (4-bit base and experts, routed-expert adapters at rank 8, 4,096-token packed rows);
2. `sft-lora.yaml` (bf16 base, 8,192-token packed rows);
3. `dpo-qlora.yaml` (4-bit, pairs of up to 4,096 tokens).

Each at the recipe's own settings (activation checkpointing on), but one row per optimizer step (accumulation 1)
and a log every step, `--warmup` steps then `--steps` timed: load time (the model read and quantized, the
adapters added), the host RAM peak while loading (the child's max RSS when loading ends: a fresh process, so
the load's own peak plus torch's and transformers' import), real tokens/s (median step after the warm-up), peak
allocated GPU memory over the whole child (load included; `torch.cuda.max_memory_allocated`) next to `validate`'s
plan for what ran. A child stopped at its cap or out of memory leaves what it had written (the load, the steps so
far): an out-of-memory is the finding, recorded as such. Writes `benchmarks/results-gpu-<device>-full-depth.txt`
(its own file: `gpu_check.py` rewrites `results-gpu-<device>.txt` whole); targets, recorded and not checks:
the 24 GB recipe's peak allocated <= 22 GiB (a 24 GB card less the CUDA context and the allocator's slack), and
every peak within 10% of its plan.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_check  # noqa: E402  (its asset, model, recipe and timing helpers: one definition of each)

ROOT = gpu_check.ROOT
TARGET_24GB_GIB = 22.0
# (section, shipped recipe, data file, share of --time-limit); the 24 GB recipe first: it is the promise at stake
RECIPES = [("sft-qlora-24gb", "ernie-4.5-21b-a3b/sft-qlora-24gb.yaml", "sft.json", 0.26),
           ("sft-lora", "ernie-4.5-21b-a3b/sft-lora.yaml", "sft.json", 0.20),
           ("dpo-qlora", "ernie-4.5-21b-a3b/dpo-qlora.yaml", "dpo.json", 0.24)]
WEIGHTS_SHARE = 0.30  # nothing runs without them: the largest share
SHM = Path("/dev/shm")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--assets", help="folder made by `gpu_check.py --prepare-assets` (default: made from --shared in a temp dir)")
    p.add_argument("--shared", default=os.environ.get("ERNIEKIT_SHARED", str(ROOT.parent / "shared")))
    p.add_argument("--out", default=str(HERE), help="folder for results-gpu-<device>-full-depth.txt")
    p.add_argument("--work", help="folder for the checkpoint (default: /dev/shm when it has room, memory-speed writes "
                                  "and reads; else the system's temp folder)")
    p.add_argument("--smoke", action="store_true", help="on CPU: a tiny 2-layer cut through the same code, no meaningful numbers")
    p.add_argument("--only", help=f"comma-separated recipes: {','.join(r[0] for r in RECIPES)} (default: all)")
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps per recipe (default 20; 2 with --smoke)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; 1 with --smoke)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds for the whole check (default 540 on a GPU, none with --smoke): the weights and each "
                        "recipe get a share and are stopped at its end (a share left unused passes to the next)")
    p.add_argument("--digest", action="store_true", help="print the source digest a results file records, then exit")
    p.add_argument("--write-weights", metavar="DIR", help=argparse.SUPPRESS)  # the checkpoint, in this process
    args = p.parse_args(argv)
    args.steps = args.steps or (2 if args.smoke else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    if args.time_limit is None and not args.smoke:
        args.time_limit = 540  # a device call's 600 s, less installing the wheels
    return args


def digest() -> str:
    return gpu_check.source_digest(Path(__file__).resolve())


def checkpoint_bytes(assets: Path, smoke: bool) -> int:
    """bf16 bytes of the weights the check writes (the model built on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(gpu_check.config_of(assets, "21b-a3b", 2 if smoke else None, smoke))
    return 2 * sum(p.numel() for p in model.parameters())


def work_folder(given: str | None, needed: int) -> str | None:
    """Where the checkpoint goes: `given`, else /dev/shm when it holds the weights with 10% to spare (a tmpfs: the
    write and each recipe's read run at memory speed, not the disk's), else the system's temp folder (None)."""
    if given:
        return given
    return str(SHM) if SHM.is_dir() and shutil.disk_usage(SHM).free > 1.1 * needed else None


# ---------------------------------------------------------------------------------------------------------------
# The parent: sections, caps, the results file (the children: `gpu_check.write_model` and `gpu_check.child_run`)


def recipe_section(results, name: str, shipped: str, data: str, model_dir: Path, assets: Path, tmp: Path, args, cap) -> None:
    settings = argparse.Namespace(steps=args.warmup + args.steps, smoke=args.smoke)
    recipe = gpu_check.recipe_from(shipped, model_dir, assets / "data" / data, tmp / name, settings)
    code, stderr, got = gpu_check.recipe_in_child(tmp / f"{name}.yaml", tmp / f"{name}.json", args.warmup, cap, args.smoke)
    plan = gpu_check.planned(recipe, *gpu_check.run_choices(got.get("lines", [])))
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    title = f"21B-A3B {name}, all {layers} layers" if not args.smoke else f"21B-A3B {name} (smoke: tiny, {layers} layers)"
    g = lambda x: "%.2f GiB" % x if x is not None else "n/a"  # noqa: E731
    lines = [f"recipes/{shipped} as shipped but for the data, one packed row per optimizer step and a log every step: "
             f"{args.warmup} steps untimed, then {args.steps}; activation checkpointing "
             f"{'on' if plan['checkpointing'] else 'off'}; child exit: {code}; stage reached: {got['stage']}"
             + (f" ({got.get('steps', 0)} steps)" if got["stage"] != "done" else "")]
    if code != 0:
        lines.append(f"last error: {gpu_check.last_error(stderr)}")
    if "load_s" in got:
        lines.append(f"load (`load_model`: read{' and quantized' if recipe.model.load_in_4bit else ''}): {got['load_s']:.1f} s; "
                     f"host RAM peak while loading (the child's max RSS, imports included): {got['host_peak_gib']:.1f} GiB; "
                     f"GPU memory allocated after loading: {g(got.get('allocated_after_load_gib'))}")
    peak = got.get("peak_allocated_gib")
    if "tokens_per_second" in got:
        lines.append(f"real tokens/s (median step after the warm-up): {got['tokens_per_second']:.0f}; train_loss {got.get('loss')}")
    elif "tokens_per_second_so_far" in got:
        lines.append(f"real tokens/s over the steps it ran (median step after the warm-up, of {len(got['rates'])} logged): "
                     f"{got['tokens_per_second_so_far']:.0f}")
    lines.append(f"peak allocated {g(peak)} (reserved {g(got.get('peak_reserved_gib'))}) vs plan {plan['plan_allocated_gib']:.2f} GiB "
                 f"allocated, {plan['plan_total_gib']:.2f} GiB total")
    results.section(f"{len(results.data.get('recipes', [])) + 1}. {title}", *lines)
    results.data.setdefault("recipes", []).append({"name": name, "layers": layers, "exit": code, **got, **plan})
    if peak is not None:
        ratio = peak / plan["plan_allocated_gib"]
        partial = "" if got["stage"] == "done" else f" (run not finished: {got['stage']})"
        if name == "sft-qlora-24gb":
            results.target(f"memory 21B-A3B sft-qlora-24gb, all {layers} layers", peak <= TARGET_24GB_GIB,
                           f"peak allocated {peak:.2f} GiB vs plan {plan['plan_allocated_gib']:.2f} GiB (target <= {TARGET_24GB_GIB:.0f} GiB){partial}")
        results.target(f"memory 21B-A3B {name} vs plan, all {layers} layers", abs(ratio - 1) <= gpu_check.MEMORY_TOLERANCE,
                       f"peak allocated {peak:.2f} GiB vs plan {plan['plan_allocated_gib']:.2f} GiB ({100 * (ratio - 1):+.1f}%; "
                       f"target within {100 * gpu_check.MEMORY_TOLERANCE:.0f}%){partial}")
    loss = got.get("loss")
    results.check(f"trains 21B-A3B {name}", got["stage"] == "done" and loss is not None and loss == loss,
                  f"stage {got['stage']}, train_loss {loss}" + (f"; {gpu_check.last_error(stderr)}" if code != 0 else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.digest:
        print(digest())
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.write_weights:  # in a child: its memory (41 GiB on the GPU at full depth) is gone when it ends
        gpu_check.write_model(Path(args.assets), "21b-a3b", Path(args.write_weights), layers=2 if args.smoke else None, smoke=args.smoke)
        return 0
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA GPU here: --smoke runs the same code on CPU, on a tiny 2-layer cut", file=sys.stderr)
        return 2
    device, slug = gpu_check.device_and_slug(args.smoke)
    results = gpu_check.Results(device, None)
    out = Path(args.out) / f"results-gpu-{slug}-full-depth.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    timings: list[str] = []
    only = set((args.only or ",".join(r[0] for r in RECIPES)).split(","))
    shares = [("weights", WEIGHTS_SHARE)] + [(r[0], r[3]) for r in RECIPES if r[0] in only]
    rev = gpu_check.revision() or "unknown"

    def cap(name: str) -> float | None:  # what is left of the limit, less the later sections' shares
        if not args.time_limit:
            return None
        later = sum(s for n, s in shares[[n for n, _ in shares].index(name) + 1:]) / sum(s for _, s in shares)
        return max(30.0, started + args.time_limit * (1 - later) - time.perf_counter())

    def write() -> None:  # after every section
        results.write(out, "benchmarks/gpu_full_depth.py", args.smoke, f"git {rev}; source {digest()}", "issue 43's", timings,
                      time.perf_counter() - started, argv)

    with tempfile.TemporaryDirectory(prefix="erniekit-full-depth-") as tmp:
        tmp = Path(tmp)
        assets = Path(args.assets) if args.assets else gpu_check.prepare_assets(tmp / "assets", Path(args.shared))
        needed = checkpoint_bytes(assets, args.smoke)
        weights = Path(tempfile.mkdtemp(prefix="erniekit-full-depth-weights-", dir=work_folder(args.work, needed)))
        try:
            section_started = time.perf_counter()
            code, stderr = gpu_check.in_child(Path(__file__), ["--write-weights", str(weights), "--assets", str(assets)] + (["--smoke"] if args.smoke else []),
                                 cap("weights"))
            model_dir = next(weights.glob("21b-a3b-*"), None)
            written = code == 0 and model_dir is not None and (model_dir / "config.json").is_file()
            seconds = time.perf_counter() - section_started
            timings.append(f"weights {seconds:.0f} s")
            size = sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file()) if model_dir else 0
            results.check("weights written", written, f"{size / 2**30:.1f} GiB in {seconds:.0f} s" if written else gpu_check.last_error(stderr))
            results.section("0. Random weights at the released config",
                            f"{size / 2**30:.2f} GiB of safetensors ({needed / 2**30:.2f} GiB of bf16 parameters) written to "
                            f"{weights.parent} in {seconds:.0f} s (initialized on the device, saved by transformers' "
                            f"save_pretrained); child exit: {code}")
            results.data["weights"] = {"bytes": size, "parameter_bytes": needed, "seconds": seconds, "exit": code, "dir": str(weights)}
            write()
            run_recipes(results, written, model_dir, assets, tmp, args, only, cap, timings, write)
        finally:
            shutil.rmtree(weights, ignore_errors=True)  # ~41 GiB, in memory when in /dev/shm
    failed = [c for c in results.checks if not c[1]]
    print(f"\n{len(results.checks) - len(failed)} of {len(results.checks)} checks passed; wrote {out} ({time.perf_counter() - started:.0f} s)")
    return 1 if failed else 0


def run_recipes(results, written: bool, model_dir, assets: Path, tmp: Path, args, only: set, cap, timings: list, write) -> None:
    for name, shipped, data, _ in RECIPES:
        if not written or name not in only:
            continue
        results.run(name, lambda: recipe_section(results, name, shipped, data, model_dir, assets, tmp, args, cap(name)), timings, write)


if __name__ == "__main__":
    sys.exit(main())
