"""One GPU call of at most 9 minutes, answering issue 66's questions in order (each part capped, written as it ends).

    python benchmarks/gpu_check.py --prepare-assets gpu-assets        # here: tokenizer, configs, data (2.6 MB)
    python benchmarks/gpu_call.py --assets gpu-assets --out $OUT      # on the GPU machine: --time-limit 480 s
    python benchmarks/gpu_call.py --smoke                             # the same code at tiny sizes, on CPU

A device call is 15 minutes of device time in all, start included: the two prepared calls (`gpu_full_depth.py`, then
`gpu_check.py --only ...`) do not fit. This one runs their sections (one definition each, imported from them) in the
order the issue asks, each part with a share of `--time-limit`; the results file
(`results-gpu-<device>-call.txt`) is rewritten as each part ends, so a call stopped early still answers the first
questions. At the call's start a child process writes the 21B-A3B's random weights at the released config (all 28
layers, ~41 GiB of safetensors, to /dev/shm when it has room): part 3 finds them written; parts 1 and 2 run beside
that writer (its GPU work and its copy to host memory), which the file says.

1. 0.3B full SFT and LoRA SFT on packed 8k rows, eager (gpu_check 2a, 2b: real tokens/s, MFU, host syncs per step
   in torch's sync debug mode, peak vs plan), then with `model.compile_layers: true` (gpu_check 9, each in a capped
   child). Targets: MFU >= 35% full SFT; LoRA >= 1.1x full SFT's tokens/s.
2. TRL's SFTTrainer on the same card and work (gpu_check 10: its own packing, checkpointing as 2a ran): ours / TRL.
3. The 21B-A3B at all 28 layers with the 24 GB recipe (`sft-qlora-24gb.yaml`, gpu_full_depth's child): peak
   allocated vs plan (target <= 22 GiB), tokens/s, load seconds. The file always carries
   `- MET|MISSED memory 21B-A3B sft-qlora-24gb, all 28 layers: ...` (`MISSED ... no result: <why>` when it could
   not run).
4. The 21B-A3B cut to 2 layers: split vs merged routed-expert LoRA, 4-bit vs bf16 experts (gpu_check 5.2, 5.2m,
   5.2q). Targets: split >= 1.3x merged's tokens/s; 4-bit >= 0.8x bf16's.
5. What is left: where a 0.3B step's time goes (gpu_check 7, torch.profiler), DPO LoRA (gpu_check 3).

The wheels and assets travel as for gpu_check (docs/performance.md, "On a GPU"; `benchmarks/gpu_wheels.sh`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_check  # noqa: E402
import gpu_full_depth  # noqa: E402

ROOT = gpu_check.ROOT
# (part, share of --time-limit): in the order; a part left unused passes its time on
PARTS = [("sft", 0.30), ("trl", 0.10), ("full-depth", 0.30), ("moe", 0.20), ("rest", 0.10)]
LORA_OVER_FULL = 1.1  # LoRA SFT's tokens/s over full SFT's
SPLIT_OVER_MERGED = 1.3
FOUR_BIT_OVER_BF16 = 0.8
FULL_DEPTH = "memory 21B-A3B sft-qlora-24gb, all 28 layers"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--assets", help="folder made by `gpu_check.py --prepare-assets` (default: made from --shared in a temp dir)")
    p.add_argument("--shared", default=os.environ.get("ERNIEKIT_SHARED", str(ROOT.parent / "shared")))
    p.add_argument("--out", default=str(HERE), help="folder for results-gpu-<device>-call.txt")
    p.add_argument("--work", help="folder for the 21B-A3B checkpoint (default: /dev/shm when it has room)")
    p.add_argument("--smoke", action="store_true", help="on CPU: tiny models through the same code, no meaningful numbers")
    p.add_argument("--rounds", type=int, default=None, help="runs per timed case (default 2; 1 with --smoke)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 12; 1 with --smoke)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; 1 with --smoke)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds for the whole call (default 480 on a GPU, none with --smoke): each part gets its share (PARTS)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the device (default: by name)")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.smoke else 2)
    args.steps = args.steps or (1 if args.smoke else 12)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    if args.time_limit is None and not args.smoke:
        args.time_limit = 480  # of a call's 540 s: installing the wheels, and one part's overrun
    # what gpu_check's sections read besides: one MoE cut, the QLoRA steps, and each section's end (`until`)
    args.moe_layers, args.qlora_steps, args.deadline = "2", 3, None
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("no CUDA GPU here: --smoke runs the same code at tiny sizes on CPU", file=sys.stderr)
        return 2
    device, slug = gpu_check.device_and_slug(args.smoke)
    peak = args.peak_tflops or next((v for k, v in gpu_check.PEAK_TFLOPS.items() if k in device), None)
    results = gpu_check.Results(device, peak if cuda else None)
    out = Path(args.out) / f"results-gpu-{slug}-call.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    started, timings = time.perf_counter(), []
    rev = gpu_check.revision() or "unknown"

    def end_of(part: str) -> float | None:  # when `part` should be done: the shares up to it, from the start
        if not args.time_limit:
            return None
        names = [n for n, _ in PARTS]
        return started + args.time_limit * sum(s for _, s in PARTS[: names.index(part) + 1])

    sections = {"sft": "sft", "compiled": "sft", "trl": "trl", "moe": "moe", "profile": "rest", "dpo": "rest"}
    args.until = lambda section: end_of(sections[section])

    def write() -> None:
        results.write(out, "benchmarks/gpu_call.py", args.smoke,
                      f"git {rev}; source {gpu_check.source_digest(Path(__file__).resolve(), HERE / 'gpu_full_depth.py')}; "
                      f"dense bf16 peak {peak} TFLOP/s", "issue 66's", timings, time.perf_counter() - started, argv)

    with tempfile.TemporaryDirectory(prefix="erniekit-gpu-call-") as tmp:
        tmp = Path(tmp)
        assets = Path(args.assets) if args.assets else gpu_check.prepare_assets(tmp / "assets", Path(args.shared))
        needed = gpu_full_depth.checkpoint_bytes(assets, args.smoke)
        weights = Path(tempfile.mkdtemp(prefix="erniekit-gpu-call-weights-", dir=gpu_full_depth.work_folder(args.work, needed)))
        writer = start_weights(weights, assets, args.smoke)
        results.section("Part 0. The 21B-A3B's weights", f"a child writes them from the call's start ({needed / 2**30:.1f} GiB of bf16 "
                        f"parameters, to {weights.parent}); parts 1 and 2 run beside it")
        try:
            from erniekit_lite.model.load import load_tokenizer

            tokenizer = load_tokenizer(str(assets / "tokenizer"))
            results.run("1 sft eager and compiled", lambda: sft_part(results, assets, tmp, args, tokenizer), timings, write)
            results.run("2 trl", lambda: gpu_check.trl_section(results, assets, tmp, args), timings, write)
            results.run("3 full depth", lambda: full_depth_part(results, writer, weights, assets, tmp, args, end_of("full-depth")),
                        timings, write)
            if not any(name == FULL_DEPTH for name, _, _ in results.targets):  # the line the issue asks for, always
                results.target(FULL_DEPTH, False, "no result: " + ("no GPU memory to measure on CPU (--smoke)" if args.smoke else
                                                                   "no peak measured (part 3's section says why)"))
                write()
            results.run("4 moe 2 layers", lambda: moe_part(results, assets, tmp, args, tokenizer), timings, write)
            for section, run in (("profile", gpu_check.profile_section), ("dpo", None)):
                if args.time_limit and time.perf_counter() > started + args.time_limit:
                    results.check(f"part 5 {section}", False, f"not run: past --time-limit {args.time_limit:.0f} s")
                    continue
                step = (lambda: run(results, assets, tmp, args)) if run else (
                    lambda: gpu_check.sft_sections(results, assets, tmp, args, tokenizer, {"dpo"}))
                results.run(f"5 {section}", step, timings, write)
        finally:
            if writer.poll() is None:
                writer.kill()
            shutil.rmtree(weights, ignore_errors=True)  # ~41 GiB, in memory when in /dev/shm
    write()
    failed = [c for c in results.checks if not c[1]]
    print(f"\n{len(results.checks) - len(failed)} of {len(results.checks)} checks passed; wrote {out} ({time.perf_counter() - started:.0f} s)")
    return 1 if failed else 0


def start_weights(weights: Path, assets: Path, smoke: bool) -> subprocess.Popen:
    """gpu_full_depth's weight writer, started now and not waited for: its output goes to a log beside the weights."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(weights.parent / f"{weights.name}.log", "w") as log:  # the child has its own copy of the file
        return subprocess.Popen([sys.executable, str(HERE / "gpu_full_depth.py"), "--write-weights", str(weights), "--assets",
                                 str(assets)] + (["--smoke"] if smoke else []), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def sft_part(results, assets: Path, tmp: Path, args, tokenizer) -> None:
    gpu_check.sft_sections(results, assets, tmp, args, tokenizer, {"sft"})
    rows = {r["section"]: r for r in results.data.get("training", [])}
    if "2a" in rows and "2b" in rows:
        ratio = rows["2b"]["tokens_per_second"]["median"] / rows["2a"]["tokens_per_second"]["median"]
        results.target("0.3B LoRA SFT over full SFT, real tokens/s", ratio >= LORA_OVER_FULL,
                       f"{ratio:.2f}x (target >= {LORA_OVER_FULL}x)")
    gpu_check.compiled_section(results, assets, tmp, args, sections=("2a", "2b"))


def full_depth_part(results, writer: subprocess.Popen, weights: Path, assets: Path, tmp: Path, args, end: float | None) -> None:
    """Wait for the weights (at most until the part's end less a minute for the run), then the 24 GB recipe in its
    child, capped at what is left of the part."""
    waited = time.perf_counter()
    try:
        code = writer.wait(timeout=max(1.0, end - 60 - time.perf_counter()) if end else None)
    except subprocess.TimeoutExpired:
        code = f"still writing after {time.perf_counter() - waited:.0f} s of waiting"
    model_dir = next(weights.glob("21b-a3b-*"), None)
    written = code == 0 and model_dir is not None and (model_dir / "config.json").is_file()
    size = sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file()) if model_dir else 0
    log = weights.parent / f"{weights.name}.log"
    why = gpu_check.last_error(log.read_text()) if log.is_file() and code not in (0, None) and not isinstance(code, str) else str(code)
    results.check("21B-A3B weights written", written, f"{size / 2**30:.1f} GiB" if written else why)
    results.section("Part 3. The 21B-A3B at all its layers: the weights", f"{size / 2**30:.2f} GiB of safetensors; writer exit {code}; part 3 "
                    f"waited {time.perf_counter() - waited:.0f} s for them")
    if not written:
        results.target(FULL_DEPTH, False, f"no result: the weights were not written ({why})")
        return
    cap = max(30.0, end - time.perf_counter()) if end else None
    gpu_full_depth.recipe_section(results, "sft-qlora-24gb", "ernie-4.5-21b-a3b/sft-qlora-24gb.yaml", "sft.json", model_dir, assets,
                                  tmp, args, cap)


def moe_part(results, assets: Path, tmp: Path, args, tokenizer) -> None:
    """gpu_check 5.2 (split expert LoRA) and 5x (merged, 4-bit experts) at the 2-layer cut, with issue 66's targets."""
    model_dir = gpu_check.write_model(assets, "21b-a3b", tmp, layers=2, smoke=args.smoke)
    args.deadline = args.until("moe")
    split = gpu_check.training_section(
        results, "5.2", "21B-A3B LoRA SFT (r 32) cut to 2 layers",
        gpu_check.recipe_from("ernie-4.5-21b-a3b/sft-lora.yaml", model_dir, assets / "data" / "sft.json", tmp / "moe-2", args,
                              **{"train.activation_checkpointing": None}), model_dir, tokenizer, args)
    gpu_check.expert_compute(results, assets, model_dir, tmp, args, tokenizer, split)
    rates = {name: row["tokens_per_second"] for name, row in results.data["moe_expert_compute"].items()}
    results.target("21B-A3B 2 layers, split over merged expert LoRA, real tokens/s", rates["split"] >= SPLIT_OVER_MERGED * rates["merged"],
                   f"{rates['split'] / rates['merged']:.2f}x (target >= {SPLIT_OVER_MERGED}x)")
    four_bit = rates.get("split, 4-bit experts")
    if four_bit is not None:
        results.target("21B-A3B 2 layers, 4-bit over bf16 experts, real tokens/s", four_bit >= FOUR_BIT_OVER_BF16 * rates["split"],
                       f"{four_bit / rates['split']:.2f}x (target >= {FOUR_BIT_OVER_BF16}x)")
    shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
