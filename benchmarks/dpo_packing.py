"""Padded vs packed DPO throughput with erniekit-lite's own DPO trainer, on the same pairs, in one run.

    python benchmarks/dpo_packing.py [--steps 8] [--batch 4] [--max-length 1024] [--rounds 1] [--samples N]

What it does
- Writes a tiny random ERNIE 4.5 dense model (hidden 256, 4 layers) with the REAL ERNIE 4.5 tokenizer (so the
  103k-row LM head and the real token lengths are in play) into a temp dir.
- Trains LoRA DPO (r16 on all seven projections, fp32, no activation checkpointing, sigmoid loss, beta 0.1; the
  reference pass is the policy with its adapter disabled) through `erniekit_lite.train.dpo.run` (`method: dpo`) on
  the first `--samples` pairs of the LLaMA-Factory DPO demo (sharegpt preference format, 300 pairs), once with
  `data.packing: false` (`PaddedPairCollator`: each sequence its own padded row) and once with `data.packing: true`
  (`PackedPairCollator`: whole pairs packed into padding-free rows of up to 2 x max_length tokens, per-sample
  attention), interleaved over `--rounds` (padded, packed, padded, packed, ...), and reads each run's
  `train_results.json`.
- Each training run is a fresh subprocess of this script, so its peak resident memory (VmHWM of that process, the
  high-water mark of its own address space, read from /proc/self/status at exit) is that mode's alone. The
  baseline (RSS after importing torch/transformers/TRL, before loading tokenizer, data and model) is also reported.
  `ru_maxrss` is NOT used in the child: Linux folds the parent's high-water mark into a child's ru_maxrss across
  fork/vfork + exec, so it would report at least the parent's size.

How "the same work" is defined (the choice this benchmark makes)
- Headline metric: real (non-pad) tokens per second, `train_tokens / train_runtime` as the trainer counts them
  (every non-pad token of chosen and rejected, prompt included, i.e. every token the model runs on).
- Padded mode: `--batch` pairs per step (2 x batch sequences, each padded to the longest in its batch) for `--steps`.
- Packed mode: a row of up to 2 x `--max-length` tokens holds several whole pairs, so the packed batch is sized to
  carry about as many pairs per step as the padded one: rows = max(1, round(batch * mean_pair_len / mean_row_len))
  (mean_pair_len = chosen + rejected tokens); and the packed step count is chosen so both modes train on about the
  same total number of real tokens: steps = max(1, round(steps * batch * mean_pair_len / (rows * mean_row_len))).
  Both numbers are printed. Real tokens/s is thus compared over (nearly) equal real-token budgets and about equal
  per-step pair counts, so optimizer-step and per-step reference-pass overhead per real token is comparable too.
  Which pairs each run draws is up to the Trainer's seeded shuffle, so the two budgets differ a little.
- Times summed over rounds per mode; tokens/s = total real tokens / total train_runtime. `logging_steps` equals each
  mode's step count, so each run logs once (at its last step) and train_results.json carries rewards/* (TRL
  averages its metrics since the previous log, so here over all of that run's steps).

Noise: CPU timings are very sensitive to other processes (see benchmarks/sft_packing.py). The 1-minute load average
before and after is printed and recorded; trust only runs that started near 0. `--threads 1` is steadier on a
shared machine; `--rounds N` interleaves the modes to spread drift over both.

Output: a markdown table (with each mode's peak RSS), the packed/padded ratio, then ONE final JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DATA_FORMAT = "sharegpt"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shared", default=os.environ.get("ERNIEKIT_SHARED", str(ROOT.parent / "shared")),
                   help="shared reference files (default: $ERNIEKIT_SHARED or ../shared beside the repo)")
    p.add_argument("--steps", type=int, default=8, help="padded optimizer steps per round (packed: matched by real tokens)")
    p.add_argument("--batch", type=int, default=4, help="padded pairs per step")
    p.add_argument("--max-length", type=int, default=1024, help="tokens per sequence (a packed row holds up to 2x)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--loss-type", default="sigmoid", help="TRL DPO loss_type")
    p.add_argument("--rounds", type=int, default=1, help="padded/packed pairs of runs, interleaved")
    p.add_argument("--samples", type=int, default=None, help="preference records to train on (default: all 300)")
    p.add_argument("--packed-batch", type=int, default=None,
                   help="packed rows per step (default: matched to the padded pairs per step, see above)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own choice)")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--released-shape", action="store_true",
                   help="random weights at the released ERNIE-4.5-0.3B size (hidden 1024, 18 layers) instead")
    p.add_argument("--verbose", action="store_true", help="show erniekit-lite's and the Trainer's own output")
    p.add_argument("--worker", metavar="SPEC", default=None, help=argparse.SUPPRESS)  # internal: one training run
    return p.parse_args(argv)


def recipe_dict(args, model_dir: Path, data_path: Path, out_dir: Path, packing: bool, batch: int, steps: int) -> dict:
    return {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "method": "dpo",
        "data": {
            "train": [{"path": str(data_path), "format": DATA_FORMAT, "max_samples": args.samples}],
            "max_length": args.max_length,
            "packing": packing,
        },
        "lora": {"r": args.lora_r, "alpha": 2 * args.lora_r, "targets": LORA_TARGETS},
        "train": {
            "beta": args.beta,
            "loss_type": [args.loss_type],
            "max_steps": steps,
            "per_device_train_batch_size": batch,
            "learning_rate": 1e-4,
            "logging_steps": steps,  # one log, at the last step: run-mean rewards/* land in train_results.json
            "save_strategy": "no",
            "report_to": "none",
            "activation_checkpointing": False,
            "seed": 0,
            "disable_tqdm": True,
        },
        "output": {"dir": str(out_dir)},
    }


# ---------------------------------------------------------------- one training run, in its own process


def _proc_status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])  # "VmHWM:   123456 kB"
    except OSError:
        pass
    return None


def _rss_now_kib() -> int | None:
    try:
        import psutil

        return psutil.Process().memory_info().rss // 1024
    except ImportError:
        return _proc_status_kib("VmRSS")


def _peak_rss_kib() -> tuple[int | None, str]:
    hwm = _proc_status_kib("VmHWM")
    if hwm is not None:
        return hwm, "VmHWM"
    import resource  # not Linux: ru_maxrss (bytes on macOS, KiB elsewhere); may include the parent's at spawn

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (peak // 1024 if sys.platform == "darwin" else peak), "ru_maxrss"


def worker(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    verbose = spec["verbose"]
    import torch
    from transformers.utils import logging as hf_logging

    from erniekit_lite.recipe import from_dict
    from erniekit_lite.train.dpo import run

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    if not verbose:
        import warnings

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' checkpointing rename notices
        warnings.filterwarnings("ignore", message=".*pin_memory.*")  # no accelerator on CPU
    recipe = from_dict(spec["recipe"], source="benchmarks/dpo_packing.py")
    baseline = _rss_now_kib()

    lines: list[str] = []
    log = print if verbose else lines.append
    sink = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
    with sink:
        out = run(recipe, log=log)
    results = json.loads((out / "train_results.json").read_text())
    peak, source = _peak_rss_kib()
    results["peak_rss_mib"] = round(peak / 1024, 1) if peak else None
    results["baseline_rss_mib"] = round(baseline / 1024, 1) if baseline else None
    results["peak_rss_source"] = source
    results["threads"] = torch.get_num_threads()
    Path(spec["result"]).write_text(json.dumps(results))
    return 0


def train_in_subprocess(recipe: dict, tmp: Path, name: str, args) -> dict:
    spec = tmp / f"{name}.spec.json"
    result = tmp / f"{name}.result.json"
    spec.write_text(json.dumps({"recipe": recipe, "threads": args.threads, "verbose": args.verbose, "result": str(result)}))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec)],
                          stdout=None if args.verbose else subprocess.PIPE, stderr=None if args.verbose else subprocess.STDOUT,
                          text=True)
    if proc.returncode != 0 or not result.is_file():
        tail = "\n".join((proc.stdout or "").splitlines()[-40:])
        raise RuntimeError(f"{name}: training subprocess failed (exit {proc.returncode})\n{tail}")
    return json.loads(result.read_text())


def git_revision() -> str | None:
    """HEAD plus '+dirty' for a modified tree, so a result says which code it measured."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


# ---------------------------------------------------------------- the benchmark


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    revision = git_revision()
    shared = Path(args.shared)
    tokenizer_src = shared / "ernie45" / "ernie-4.5-0.3b-base-pt"
    data_path = shared / "data" / "llamafactory" / "dpo_en_demo.json"
    if not tokenizer_src.is_dir() or not data_path.is_file():
        print(f"shared reference files not found under {shared} (set --shared or ERNIEKIT_SHARED)", file=sys.stderr)
        return 2

    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from erniekit_lite.data.prepare import prepare_pairs
    from erniekit_lite.recipe import DataSection
    from erniekit_lite.tiny import write_tiny

    if not args.verbose:
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()

    with tempfile.TemporaryDirectory(prefix="erniekit-bench-dpo-") as tmp:
        tmp = Path(tmp)
        # The real tokenizer re-saved as tokenizer.json: loads in ~1 s instead of ~6 s from sentencepiece
        tok_dir = tmp / "tokenizer"
        AutoTokenizer.from_pretrained(tokenizer_src).save_pretrained(tok_dir)
        model_dir = write_tiny(str(tmp / "tiny"), "dense", str(tok_dir), hidden_size=args.hidden_size, layers=args.layers,
                               released_shape=args.released_shape)
        if args.released_shape:
            args.hidden_size, args.layers = 1024, 18
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        quiet = lambda *a, **k: None  # noqa: E731

        # Plan the packed batch and steps from the very pairs the runs train on
        source = {"path": str(data_path), "format": DATA_FORMAT, "max_samples": args.samples}
        planned = prepare_pairs(DataSection(train=[source], max_length=args.max_length, packing=True), tokenizer, log=quiet)
        pairs = planned.train.pairs
        seq_lengths = planned.train.stats.lengths
        pair_lengths = [len(p) for p in pairs]
        mean_pair = statistics.mean(pair_lengths)
        mean_row = statistics.mean(len(r.input_ids) for r in planned.train.rows)
        pairs_per_row = len(pairs) / len(planned.train.rows)
        # padding efficiency the padded collator would reach over the whole set, in batches of --batch (data order)
        padded_slots = sum(2 * len(group) * max(seq_lengths[2 * i : 2 * i + 2 * len(group)])
                           for i in range(0, len(pairs), args.batch) for group in [pairs[i : i + args.batch]])
        per_step = args.batch * mean_pair  # real tokens a padded step carries, on average
        packed_batch = args.packed_batch or max(1, round(per_step / mean_row))
        packed_steps = max(1, round(args.steps * per_step / (packed_batch * mean_row)))
        plan = {
            "padded": (args.batch, args.steps),
            "packed": (packed_batch, packed_steps),
        }
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(planned.train.stats.skipped.items())) or "none"
        print(f"# DPO padded vs packed, tiny ERNIE 4.5 dense (hidden {args.hidden_size}, {args.layers} layers, real tokenizer), "
              f"LoRA r{args.lora_r} x7, fp32, {args.loss_type} beta {args.beta}, torch {torch.__version__} on "
              f"{args.threads or torch.get_num_threads()} CPU threads")
        print(f"data: {len(pairs)} dpo_en_demo pairs (skipped: {skipped}; truncated to {args.max_length}: "
              f"{planned.train.stats.truncated}), sequences mean {statistics.mean(seq_lengths):.1f} tokens (max {max(seq_lengths)}), "
              f"pairs mean {mean_pair:.1f}; {len(planned.train.rows)} packed rows of {2 * args.max_length}, mean {mean_row:.0f} tokens "
              f"({pairs_per_row:.2f} pairs/row, efficiency {planned.train.packing_efficiency:.1%}); "
              f"padded batches of {args.batch} pairs in data order: {sum(pair_lengths) / padded_slots:.1%} real")
        print(f"plan: padded {args.batch} pairs/step x {args.steps} steps; "
              f"packed {packed_batch} row(s)/step (~{packed_batch * mean_row / mean_pair:.1f} pairs) x {packed_steps} steps; "
              f"{args.rounds} round(s), interleaved, each run in its own process", flush=True)

        results: dict[str, list[dict]] = {"padded": [], "packed": []}
        for rnd in range(args.rounds):
            for mode in ("padded", "packed"):
                batch, steps = plan[mode]
                recipe = recipe_dict(args, model_dir, data_path, tmp / f"run-{mode}-{rnd}", mode == "packed", batch, steps)
                r = train_in_subprocess(recipe, tmp, f"{mode}-{rnd}", args)
                results[mode].append(r)
                print(f"round {rnd + 1} {mode}: {r['train_tokens']} real tokens in {r['train_runtime']:.2f} s = "
                      f"{r['train_tokens_per_second']:.0f} tokens/s, efficiency {r['packing_efficiency']:.1%}, "
                      f"peak RSS {r['peak_rss_mib']} MiB (baseline {r['baseline_rss_mib']} MiB), "
                      f"reward accuracy {r.get('rewards/accuracies', float('nan')):.2f}", flush=True)

    summary = {}
    for mode, runs in results.items():
        tokens = sum(r["train_tokens"] for r in runs)
        seconds = sum(r["train_runtime"] for r in runs)
        peaks = [r["peak_rss_mib"] for r in runs if r.get("peak_rss_mib") is not None]
        summary[mode] = {
            "batch": plan[mode][0],
            "steps": plan[mode][1],
            "real_tokens": tokens,
            "seconds": round(seconds, 3),
            "real_tokens_per_second": round(tokens / seconds, 2) if seconds else 0.0,
            "efficiency": round(statistics.mean(r["packing_efficiency"] for r in runs), 4),
            "per_round_tokens_per_second": [r["train_tokens_per_second"] for r in runs],
            "train_loss": [round(r["train_loss"], 4) for r in runs],
            "rewards_accuracies": [r.get("rewards/accuracies") for r in runs],
            "rewards_margins": [r.get("rewards/margins") for r in runs],
            "peak_rss_mib": max(peaks) if peaks else None,
            "per_round_peak_rss_mib": [r.get("peak_rss_mib") for r in runs],
            "baseline_rss_mib": [r.get("baseline_rss_mib") for r in runs],
            "peak_rss_source": runs[0].get("peak_rss_source"),
        }
    pad, pck = summary["padded"], summary["packed"]
    ratio = pck["real_tokens_per_second"] / pad["real_tokens_per_second"] if pad["real_tokens_per_second"] else 0.0
    mem_ratio = pck["peak_rss_mib"] / pad["peak_rss_mib"] if pad["peak_rss_mib"] and pck["peak_rss_mib"] else None
    threads = results["padded"][0].get("threads") if results["padded"] else None
    wall = time.perf_counter() - t_start
    load_end = os.getloadavg()[0]
    revision_end = git_revision()

    print()
    print("| mode | batch x steps | real tokens | seconds | real tokens/s | packing/padding efficiency | peak RSS MiB |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for mode in ("padded", "packed"):
        s = summary[mode]
        unit = "pairs" if mode == "padded" else "rows"
        peak = f"{s['peak_rss_mib']:.0f}" if s["peak_rss_mib"] is not None else "n/a"
        print(f"| {mode} | {s['batch']} {unit} x {s['steps']} | {s['real_tokens']} | {s['seconds']:.2f} | "
              f"{s['real_tokens_per_second']:.0f} | {s['efficiency']:.1%} | {peak} |")
    print()
    print(f"packed / padded real tokens/s: {ratio:.2f}x")
    if mem_ratio is not None:
        print(f"packed / padded peak RSS: {mem_ratio:.2f}x (per-process {pad['peak_rss_source']}, each run in its own process; "
              f"baseline after imports ~{pad['baseline_rss_mib'][0]} MiB)")
    print(f"wall time: {wall:.1f} s; 1-min load average {load_start:.2f} at start, {load_end:.2f} at end"
          + (" (above 1: other processes may have competed; timings may be noisy)" if load_start > 1.0 else ""))
    if revision_end != revision:
        print(f"WARNING: the checkout changed during the run ({revision} -> {revision_end}); the modes may have run different code")
    print(json.dumps({
        "benchmark": "dpo_packing",
        "config": {"hidden_size": args.hidden_size, "layers": args.layers, "lora_r": args.lora_r, "max_length": args.max_length,
                   "samples": args.samples, "pairs": len(pairs), "rounds": args.rounds, "steps": args.steps, "batch": args.batch,
                   "loss_type": args.loss_type, "beta": args.beta, "threads": threads, "torch": torch.__version__,
                   "git": revision if revision_end == revision else [revision, revision_end]},
        "padded": pad,
        "packed": pck,
        "ratio_packed_over_padded": round(ratio, 3),
        "peak_rss_ratio_packed_over_padded": round(mem_ratio, 3) if mem_ratio is not None else None,
        "wall_seconds": round(wall, 1),
        "loadavg_1min": [round(load_start, 2), round(load_end, 2)],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
