"""SFT throughput: erniekit-lite packed and padded vs plain TRL SFTTrainer and LLaMA-Factory, one run, interleaved.

    python benchmarks/sft.py [--steps 12] [--batch 8] [--max-length 1024] [--rounds 1] [--samples N] [--modes a,b]
                             [--lf-python ../lf-venv/bin/python] [--threads N]

Setup (every mode): a tiny random ERNIE 4.5 dense model (hidden 256, 4 layers) with the REAL ERNIE 4.5 tokenizer
(101k tokens, so the LM head and the real token lengths are in play), written once into a temp dir; LoRA r16
(alpha 32, dropout 0) on q,k,v,o,gate,up,down; fp32; sdpa attention (erniekit-lite packed: its per-sample
`packed_sdpa`); no activation checkpointing; learning rate 1e-4; seed 0; the first `--samples` records of the
alpaca demo (default: all 999), written to one file that every mode reads; max length 1024; trained on the
response only.

Modes (each in its own child process, so peak RSS is that mode's and the peers' imports never meet):
- erniekit-padded: `erniekit_lite.train.sft.run`, `data.packing: false`: `--batch` samples per step, each padded to
  the longest in its batch, `--steps` steps.
- erniekit-packed: `data.packing: true`: padding-free rows of up to max_length, sized as in sft_packing.py so the
  work matches the padded mode: rows/step = round(batch x mean sample length / mean row length) (about the same
  samples per step), steps = round(steps x batch x mean sample / (rows x mean row)) (about the same real tokens).
- trl-padded / trl-padding-free / trl-bfd: `runners/trl_sft.py`, a plain TRL script (SFTTrainer, conversational
  prompt/completion built from alpaca, the tokenizer's ERNIE chat template): per_device_train_batch_size `--batch`,
  max_steps `--steps`, as a user would set them. padded: 8 samples padded to the longest. padding_free: the same 8
  samples concatenated into one [1, T] row (no padding). bfd: 8 best-fit-decreasing packed rows of up to 1024
  tokens per step, i.e. ~5-6x the samples and real tokens per step of the padded modes.
- lf-padded / lf-neat-packing: `runners/llamafactory.py` under LLaMA-Factory's own venv (`--lf-python`), its
  `run_exp` with stage sft, template ernie_nothink, per_device_train_batch_size `--batch`, max_steps `--steps`.
  padded: 8 samples (padded to the longest, rounded up to a multiple of 8). neat_packing: 8 greedy-knapsack rows
  of 1024 positions (pad-filled) per step, a block-diagonal 4-D mask under sdpa: like trl-bfd, ~5-6x the work per
  step.
The peers' packed modes are sized as their users would size them (the batch is still 8 rows), so each mode's total
work differs: the table shows rows x steps, the samples and real tokens per step of every mode, and real tokens/s
is the headline (the comparison is fair per token, not per run).

The metric (benchmarks/_common.py, the same for every mode): real tokens = non-pad input tokens of the batches the
training steps actually consumed, counted by the benchmark's probe (collator + training_step wrappers), divided by
the wall-clock seconds of `Trainer.train()` (the Trainer's own train_runtime is in the JSON). Each peer's own
throughput figure is shown beside it (erniekit-lite: its train_tokens_per_second; TRL: its `num_tokens` over
train_runtime; LLaMA-Factory: its `effective_tokens_per_sec`) so discrepancies are visible.

Noise: CPU timings are very sensitive to other processes on the 2 cores. The 1-minute load average before and
after is printed; trust only runs that started near 0. `--rounds N` interleaves the modes to spread drift.
Output: a header (machine, threads, both venvs' versions), the plan, a markdown table, then ONE final JSON line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

sys.path.insert(0, str(C.ROOT))  # run from a checkout without installing

MODES = ["erniekit-padded", "erniekit-packed", "trl-padded", "trl-padding-free", "trl-bfd", "lf-padded", "lf-neat-packing"]
BASELINE = "trl-padded"


def parse_args(argv=None, packing_only: bool = False):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_common_args(p, steps=12, batch=8, samples=400 if packing_only else None,
                      modes=MODES[:2] if packing_only else MODES, lf=not packing_only)
    args = p.parse_args(argv)
    if packing_only:
        args.lf_python = None
    return args


def main(argv=None, packing_only: bool = False) -> int:
    args = parse_args(argv, packing_only)
    modes = C.selected_modes(args, MODES)
    t_start, load_start, revision = time.perf_counter(), os.getloadavg()[0], C.git_revision()
    demo = C.demo_file(args.shared, "alpaca_en_demo.json")
    notes = []
    lf_python = getattr(args, "lf_python", None)
    if any(m.startswith("lf-") for m in modes) and not (lf_python and Path(lf_python).exists()):
        notes.append(f"LLaMA-Factory modes skipped: no python at {lf_python} (--lf-python)")
        modes = [m for m in modes if not m.startswith("lf-")]

    from transformers import AutoTokenizer

    from erniekit_lite.data.prepare import prepare
    from erniekit_lite.recipe import DataSection

    C.quiet_transformers()
    main_versions = C.versions(sys.executable)
    lf_versions = C.versions(lf_python) if any(m.startswith("lf-") for m in modes) else None

    with tempfile.TemporaryDirectory(prefix="erniekit-bench-sft-") as tmp:
        tmp = Path(tmp)
        model_dir = C.write_model(tmp, args)
        data_path = tmp / "data" / "alpaca.json"
        records = C.write_records(demo, data_path, args.samples)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        quiet = lambda *a, **k: None  # noqa: E731

        # erniekit-lite's packed plan, from the very records every mode trains on
        planned = prepare(DataSection(train=[{"path": str(data_path), "format": "alpaca"}], max_length=args.max_length, packing=True),
                          tokenizer, log=quiet)
        lengths = planned.train.stats.lengths
        mean_len = statistics.mean(lengths)
        mean_row = statistics.mean(len(r.input_ids) for r in planned.train.rows)
        per_step = args.batch * mean_len  # real tokens a padded step carries, on average
        packed_batch = args.packed_batch or max(1, round(per_step / mean_row))
        packed_steps = max(1, round(args.steps * per_step / (packed_batch * mean_row)))
        eff_2048 = None
        if packing_only:  # the packer alone on the full demo at 2048 (no training)
            full = prepare(DataSection(train=[{"path": str(demo), "format": "alpaca"}], max_length=2048, packing=True), tokenizer, log=quiet)
            eff_2048, full_rows, full_samples = full.train.packing_efficiency, len(full.train.rows), len(full.train.samples)

        def spec(mode: str, rnd: int):
            out = str(tmp / f"run-{mode}-{rnd}")
            common = {"model_dir": str(model_dir), "data_path": str(data_path), "out_dir": out, "max_length": args.max_length,
                      "lora_r": args.lora_r, "verbose": args.verbose}
            if mode.startswith("erniekit-"):
                packed = mode == "erniekit-packed"
                return sys.executable, "erniekit", {**common, "method": "sft", "data_format": "alpaca", "packing": packed,
                                                    "batch": packed_batch if packed else args.batch,
                                                    "steps": packed_steps if packed else args.steps}
            if mode.startswith("trl-"):
                return sys.executable, "trl_sft", {**common, "mode": {"trl-padded": "padded", "trl-padding-free": "padding_free",
                                                                      "trl-bfd": "bfd"}[mode], "batch": args.batch, "steps": args.steps}
            return lf_python, "llamafactory", {**common, "stage": "sft", "neat_packing": mode == "lf-neat-packing",
                                               "batch": args.batch, "steps": args.steps}

        title = ("SFT padded vs packed (erniekit-lite)" if packing_only else
                 "SFT throughput: erniekit-lite vs plain TRL SFTTrainer vs LLaMA-Factory")
        for line in C.describe_header(f"{title}; tiny ERNIE 4.5 dense (hidden {args.hidden_size}, {args.layers} layers, real "
                                      f"tokenizer), LoRA r{args.lora_r} x7, fp32, sdpa, max length {args.max_length}",
                                      args, main_versions, lf_versions):
            print(line)
        print(f"data: {len(records)} alpaca records; erniekit-lite tokenization: {len(lengths)} samples, mean {mean_len:.1f} tokens "
              f"(max {max(lengths)}); {len(planned.train.rows)} packed rows of {args.max_length}, mean {mean_row:.0f} tokens")
        print(f"plan: padded modes {args.batch} samples/step x {args.steps} steps; erniekit-packed {packed_batch} row(s)/step "
              f"(~{packed_batch * mean_row / mean_len:.1f} samples) x {packed_steps} steps (matched real-token budget); "
              f"trl-padding-free {args.batch} samples in one row/step, trl-bfd and lf-neat-packing {args.batch} packed rows/step, "
              f"x {args.steps} steps; {args.rounds} round(s), interleaved, each mode in its own process")
        for note in notes:
            print("note:", note)
        print(f"modes: {', '.join(modes)}", flush=True)

        runs = C.run_modes(modes, spec, tmp, args)

    summary, baseline = C.summarise_modes(runs, BASELINE)

    print()
    C.print_table(summary, baseline, "rows")
    print()
    print("rows: samples per step (padded and padding-free modes) or packed rows per step (packed modes); real tokens: non-pad tokens the training steps consumed (benchmark's own count); seconds: wall "
          "clock of Trainer.train(); non-pad share: real tokens / forwarded positions.")
    extra = {}
    if "erniekit-padded" in summary and "erniekit-packed" in summary and "error" not in summary["erniekit-padded"] \
            and "error" not in summary["erniekit-packed"]:
        ratio = summary["erniekit-packed"]["real_tokens_per_second"] / summary["erniekit-padded"]["real_tokens_per_second"]
        extra["ratio_packed_over_padded"] = round(ratio, 3)
        print(f"erniekit-lite packed / padded real tokens/s: {ratio:.2f}x" + (f" (target >= 1.8x: {'met' if ratio >= 1.8 else 'NOT met'})" if packing_only else ""))
    if eff_2048 is not None:
        extra["packing_efficiency_2048_full_alpaca"] = round(eff_2048, 4)
        print(f"packing efficiency, full alpaca demo ({full_samples} samples) at max_length 2048: {eff_2048:.2%} in {full_rows} rows "
              f"(target >= 97%: {'met' if eff_2048 >= 0.97 else 'NOT met'})")
    C.print_tail(
        benchmark="sft_packing" if packing_only else "sft",
        config={"hidden_size": args.hidden_size, "layers": args.layers, "lora_r": args.lora_r, "max_length": args.max_length,
                "samples": len(records), "rounds": args.rounds, "steps": args.steps, "batch": args.batch,
                "erniekit_packed": [packed_batch, packed_steps], "threads": args.threads},
        summary=summary, baseline=baseline, extra=extra, notes=notes, started=(t_start, load_start, revision),
        main_versions=main_versions, lf_versions=lf_versions,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
