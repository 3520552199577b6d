"""DPO throughput and memory: erniekit-lite packed and padded vs plain TRL DPOTrainer and LLaMA-Factory DPO.

    python benchmarks/dpo.py [--steps 12] [--batch 4] [--max-length 1024] [--rounds 1] [--samples N] [--modes a,b]
                             [--lf-python ../lf-venv/bin/python] [--threads N]

Setup (every mode): the tiny random ERNIE 4.5 dense model (hidden 256, 4 layers, the REAL 101k-token tokenizer),
written once; LoRA r16 (alpha 32, dropout 0) on q,k,v,o,gate,up,down; fp32; sdpa (erniekit-lite packed: its
per-sample `packed_sdpa`); no activation checkpointing; sigmoid loss, beta 0.1; the reference pass is the policy
with its adapter disabled (every mode, computed in each step, not precomputed); learning rate 1e-4; seed 0; the
first `--samples` records (default: all 300) of LLaMA-Factory's dpo_en_demo (sharegpt: conversations with
system / multi-turn prompts, chosen / rejected), written to one file that every mode reads; max length 1024 per
sequence.

Modes (each in its own child process: peak RSS = VmHWM of that process alone):
- erniekit-padded: `erniekit_lite.train.dpo.run`, `data.packing: false`: `--batch` pairs per step (2 x batch
  sequences, each padded to the longest), `--steps` steps.
- erniekit-packed: `data.packing: true`: whole pairs packed into padding-free rows of up to 2 x max_length, sized
  as in dpo_packing.py to match the padded work: rows/step = round(batch x mean pair / mean row), steps =
  round(steps x batch x mean pair / (rows x mean row)).
- trl: `runners/trl_dpo.py`, a plain TRL script (DPOTrainer, conversational preference data, the tokenizer's ERNIE
  chat template), per_device_train_batch_size `--batch`, max_steps `--steps`; TRL 1.16 has no padding-free DPO.
- lf: `runners/llamafactory.py` under LLaMA-Factory's own venv (`--lf-python`), `run_exp` with stage dpo, template
  ernie_nothink, per_device_train_batch_size `--batch`, max_steps `--steps` (LLaMA-Factory has no packed DPO).
Overlong data is handled each tool's own way: erniekit-lite skips pairs whose prompt alone exceeds max_length and
cuts the rest; TRL cuts each prompt+response to max_length (keep_start), so a long prompt can leave no response;
LLaMA-Factory shortens prompt and responses proportionally to fit cutoff_len. Real tokens count what each forwards.

The metric (benchmarks/_common.py, the same for every mode): real tokens = non-pad tokens of the chosen and
rejected sequences (prompt included) of the batches the training steps consumed, counted by the benchmark's
probe, divided by the wall-clock seconds of `Trainer.train()`. Each peer's own figure is shown beside it
(erniekit-lite: train_tokens_per_second; TRL: `num_tokens` / train_runtime; LLaMA-Factory: effective_tokens_per_sec).

Noise: see benchmarks/sft.py; trust runs that started near load 0. Output: a header (machine, threads, both
venvs' versions), the plan, a markdown table (with peak RSS), then ONE final JSON line.
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

MODES = ["erniekit-padded", "erniekit-packed", "trl", "lf"]
BASELINE = "trl"
DATA_FORMAT = "sharegpt"


def parse_args(argv=None, packing_only: bool = False):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_common_args(p, steps=8 if packing_only else 12, batch=4, samples=None,
                      modes=MODES[:2] if packing_only else MODES, lf=not packing_only)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--loss-type", default="sigmoid", help="DPO loss (sigmoid in every mode)")
    args = p.parse_args(argv)
    if packing_only:
        args.lf_python = None
    return args


def main(argv=None, packing_only: bool = False) -> int:
    args = parse_args(argv, packing_only)
    modes = C.selected_modes(args, MODES)
    t_start, load_start, revision = time.perf_counter(), os.getloadavg()[0], C.git_revision()
    demo = C.demo_file(args.shared, "dpo_en_demo.json")
    notes = []
    lf_python = args.lf_python
    if "lf" in modes and not (lf_python and Path(lf_python).exists()):
        notes.append(f"LLaMA-Factory mode skipped: no python at {lf_python} (--lf-python)")
        modes = [m for m in modes if m != "lf"]

    from transformers import AutoTokenizer

    from erniekit_lite.data.prepare import prepare_pairs
    from erniekit_lite.recipe import DataSection

    C.quiet_transformers()
    main_versions = C.versions(sys.executable)
    lf_versions = C.versions(lf_python) if "lf" in modes else None

    with tempfile.TemporaryDirectory(prefix="erniekit-bench-dpo-") as tmp:
        tmp = Path(tmp)
        model_dir = C.write_model(tmp, args)
        data_path = tmp / "data" / "dpo.json"
        records = C.write_records(demo, data_path, args.samples)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)

        # erniekit-lite's packed plan, from the very records every mode trains on
        planned = prepare_pairs(DataSection(train=[{"path": str(data_path), "format": DATA_FORMAT}], max_length=args.max_length,
                                            packing=True), tokenizer, log=lambda *a, **k: None)
        pairs = planned.train.pairs
        seq_lengths = planned.train.stats.lengths
        mean_pair = statistics.mean(len(p) for p in pairs)
        mean_row = statistics.mean(len(r.input_ids) for r in planned.train.rows)
        per_step = args.batch * mean_pair  # real tokens a padded step carries, on average
        packed_batch = args.packed_batch or max(1, round(per_step / mean_row))
        packed_steps = max(1, round(args.steps * per_step / (packed_batch * mean_row)))

        def spec(mode: str, rnd: int):
            common = {"model_dir": str(model_dir), "data_path": str(data_path), "out_dir": str(tmp / f"run-{mode}-{rnd}"),
                      "max_length": args.max_length, "lora_r": args.lora_r, "beta": args.beta, "loss_type": args.loss_type,
                      "verbose": args.verbose}
            if mode.startswith("erniekit-"):
                packed = mode == "erniekit-packed"
                return sys.executable, "erniekit", {**common, "method": "dpo", "data_format": DATA_FORMAT, "packing": packed,
                                                    "batch": packed_batch if packed else args.batch,
                                                    "steps": packed_steps if packed else args.steps}
            if mode == "trl":
                return sys.executable, "trl_dpo", {**common, "batch": args.batch, "steps": args.steps}
            return lf_python, "llamafactory", {**common, "stage": "dpo", "batch": args.batch, "steps": args.steps}

        title = "DPO padded vs packed (erniekit-lite)" if packing_only else \
            "DPO throughput and memory: erniekit-lite vs plain TRL DPOTrainer vs LLaMA-Factory"
        for line in C.describe_header(f"{title}; tiny ERNIE 4.5 dense (hidden {args.hidden_size}, {args.layers} layers, real "
                                      f"tokenizer), LoRA r{args.lora_r} x7, fp32, sdpa, {args.loss_type} beta {args.beta}, "
                                      f"max length {args.max_length}", args, main_versions, lf_versions):
            print(line)
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(planned.train.stats.skipped.items())) or "none"
        print(f"data: {len(records)} dpo_en_demo records; erniekit-lite: {len(pairs)} pairs (skipped: {skipped}; truncated to "
              f"{args.max_length}: {planned.train.stats.truncated}), sequences mean {statistics.mean(seq_lengths):.1f} tokens "
              f"(max {max(seq_lengths)}), pairs mean {mean_pair:.1f}; {len(planned.train.rows)} packed rows of {2 * args.max_length}, "
              f"mean {mean_row:.0f} tokens")
        print(f"plan: padded modes {args.batch} pairs/step x {args.steps} steps; erniekit-packed "
              f"{packed_batch} row(s)/step (~{packed_batch * mean_row / mean_pair:.1f} pairs) x {packed_steps} steps (matched "
              f"real-token budget); {args.rounds} round(s), interleaved, each mode in its own process")
        for note in notes:
            print("note:", note)
        print(f"modes: {', '.join(modes)}", flush=True)

        runs = C.run_modes(modes, spec, tmp, args)

    summary, baseline = C.summarise_modes(runs, BASELINE)

    print()
    C.print_table(summary, baseline, "rows")
    print()
    print("rows: pairs per step for padded modes (2 sequences each), packed rows per step for erniekit-packed; seq/step counts "
          "chosen and rejected sequences; real tokens: non-pad tokens of both sequences, prompt included, that the training "
          "steps consumed (benchmark's own count); seconds: wall clock of Trainer.train(); peak RSS: VmHWM of the mode's process.")
    extra = {}
    pad, pck = summary.get("erniekit-padded", {}), summary.get("erniekit-packed", {})
    if pad and pck and "error" not in pad and "error" not in pck:
        ratio = pck["real_tokens_per_second"] / pad["real_tokens_per_second"]
        extra["ratio_packed_over_padded"] = round(ratio, 3)
        line = f"erniekit-lite packed / padded real tokens/s: {ratio:.2f}x"
        if pad["peak_rss_mib"] and pck["peak_rss_mib"]:
            extra["peak_rss_ratio_packed_over_padded"] = round(pck["peak_rss_mib"] / pad["peak_rss_mib"], 3)
            line += f"; peak RSS {extra['peak_rss_ratio_packed_over_padded']:.2f}x"
        print(line)
    C.print_tail(
        benchmark="dpo_packing" if packing_only else "dpo",
        config={"hidden_size": args.hidden_size, "layers": args.layers, "lora_r": args.lora_r, "max_length": args.max_length,
                "records": len(records), "erniekit_pairs": len(pairs), "rounds": args.rounds, "steps": args.steps,
                "batch": args.batch, "erniekit_packed": [packed_batch, packed_steps], "loss_type": args.loss_type,
                "beta": args.beta, "threads": args.threads},
        summary=summary, baseline=baseline, extra=extra, notes=notes, started=(t_start, load_start, revision),
        main_versions=main_versions, lf_versions=lf_versions,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
