"""DPO vs ORPO vs SimPO (erniekit-lite, packed pair rows, LoRA): real tokens/s and peak RSS per method.

    python benchmarks/preference_methods.py [--steps 4] [--batch 2] [--max-length 1024] [--rounds 3] [--samples 80]
                                            [--modes dpo,orpo,simpo] [--threads N]

Setup (every method; benchmarks/_common.py and runners/erniekit.py): the tiny random ERNIE 4.5 dense model (hidden
256, 4 layers, the REAL 101k-token tokenizer), written once; LoRA r16 (alpha 32) on the seven projections; fp32;
`packed_sdpa`; no activation checkpointing; learning rate 1e-4; seed 0; the first `--samples` pairs of
LLaMA-Factory's dpo_en_demo (sharegpt preference format), packed whole into padding-free rows of up to
2 x max_length tokens. Every method trains the same rows: `--batch` rows per step for `--steps` steps.
- dpo: sigmoid loss, beta 0.1; its reference pass is the policy with the adapter disabled (a no-grad forward
  of the same rows in every step);
- orpo: beta 0.1 (TRL's ORPOTrainer loss; no reference);
- simpo: beta 2.0, simpo_gamma 1.0, cpo_alpha 0 (TRL's CPOTrainer, loss_type simpo; no reference).

Metric (the probe of benchmarks/_common.py): real tokens (chosen and rejected, prompt included) that the training
steps consumed, over the wall clock of `Trainer.train()`; the reference pass is not counted as tokens, so DPO's
figure carries its cost. Peak RSS: VmHWM of the run's own child process. Each method runs once per round, the
methods interleaved (dpo, orpo, simpo, dpo, ...); the table gives min / median / max over the rounds.

This file is also the child's runner: `_common.worker` loads `runners/<name>.py`, and `../preference_methods`
names this file, whose `run` trains through the method's own module (the CLI's dispatch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import _common as C  # noqa: E402

sys.path.insert(0, str(C.ROOT))  # run from a checkout without installing

MODES = ["dpo", "orpo", "simpo"]
TRAIN = {"dpo": {}, "orpo": {"beta": 0.1}, "simpo": {"beta": 2.0, "simpo_gamma": 1.0}}  # dpo: runners/erniekit.py's
DATA_FORMAT = "sharegpt"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_common_args(p, steps=4, batch=2, samples=80, modes=MODES, lf=False)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.lf_python = None
    modes = C.selected_modes(args, MODES)
    t_start, load_start, revision = time.perf_counter(), os.getloadavg()[0], C.git_revision()
    shared = Path(args.shared)
    demo = shared / "data" / "llamafactory" / "dpo_en_demo.json"
    if not (shared / "ernie45" / "ernie-4.5-0.3b-base-pt").is_dir() or not demo.is_file():
        print(f"shared reference files not found under {shared} (set --shared or ERNIEKIT_SHARED)", file=sys.stderr)
        return 2

    from transformers import AutoTokenizer

    from erniekit_lite.data.prepare import prepare_pairs
    from erniekit_lite.recipe import DataSection

    C.quiet_transformers()
    versions = C.versions(sys.executable)
    with tempfile.TemporaryDirectory(prefix="erniekit-bench-preference-") as tmp:
        tmp = Path(tmp)
        model_dir = C.write_model(tmp, args)
        data_path = tmp / "data" / "pairs.json"
        records = C.write_records(demo, data_path, args.samples)
        planned = prepare_pairs(DataSection(train=[{"path": str(data_path), "format": DATA_FORMAT}], max_length=args.max_length,
                                            packing=True), AutoTokenizer.from_pretrained(model_dir), log=lambda *a, **k: None)
        rows = planned.train.rows

        def spec(mode: str, rnd: int):
            return sys.executable, "../preference_methods", {
                "model_dir": str(model_dir), "data_path": str(data_path), "data_format": DATA_FORMAT, "out_dir": str(tmp / f"run-{mode}-{rnd}"),
                "max_length": args.max_length, "lora_r": args.lora_r, "method": mode, "packing": True, "batch": args.batch,
                "steps": args.steps, "beta": 0.1, "loss_type": "sigmoid", "train": TRAIN[mode], "verbose": args.verbose}

        for line in C.describe_header(f"DPO vs ORPO vs SimPO (erniekit-lite, packed pair rows); tiny ERNIE 4.5 dense (hidden "
                                      f"{args.hidden_size}, {args.layers} layers, real tokenizer), LoRA r{args.lora_r} x7, fp32, "
                                      f"packed_sdpa, max length {args.max_length}", args, versions, None):
            print(line)
        print(f"git: {revision}; rounds: {args.rounds} (methods interleaved, each run in its own process)")
        print(f"data: {len(records)} dpo_en_demo records -> {len(planned.train.pairs)} pairs in {len(rows)} packed rows of up to "
              f"{2 * args.max_length} tokens (mean {statistics.mean(len(r.input_ids) for r in rows):.0f}); every method: "
              f"{args.batch} rows/step x {args.steps} steps")
        print("settings: dpo sigmoid beta 0.1 (reference: adapter disabled); orpo beta 0.1; simpo beta 2.0, simpo_gamma 1.0, "
              "cpo_alpha 0", flush=True)
        runs = C.run_modes(modes, spec, tmp, args)

    summary, _ = C.summarise_modes(runs, "dpo")
    print()
    table(summary, runs)
    print()
    print("real tokens/s: the probe's real tokens (chosen + rejected, prompt included) over the wall clock of Trainer.train(), "
          "per round; peak RSS: VmHWM of the run's process; x dpo: median over dpo's median. The machine may be shared: "
          "see the load average below.")
    C.print_tail(benchmark="preference_methods",
                 config={"hidden_size": args.hidden_size, "layers": args.layers, "lora_r": args.lora_r, "max_length": args.max_length,
                         "records": len(records), "pairs": len(planned.train.pairs), "rounds": args.rounds, "steps": args.steps,
                         "rows_per_step": args.batch, "threads": args.threads, "train": TRAIN},
                 summary=summary, baseline="dpo" if "dpo" in summary and "error" not in summary["dpo"] else None, extra={},
                 notes=[], started=(t_start, load_start, revision), main_versions=versions, lf_versions=None)
    return 0


def spread(values: list[float], fmt: str) -> str:
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values))) if values else "-"


def table(summary: dict, runs: dict) -> None:
    base = summary.get("dpo", {}).get("per_round_real_tokens_per_second")
    print("| method | real tokens per run | real tokens/s min / median / max | x dpo (median) | peak RSS MiB min / median / max "
          "| reward accuracy (mean over the run, per round) | train loss |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: |")
    for mode, s in summary.items():
        if "error" in s:
            print(f"| {mode} | FAILED: {s['error'].replace('|', '/')} | | | | | |")
            continue
        tps = s["per_round_real_tokens_per_second"]
        ratio = f"{statistics.median(tps) / statistics.median(base):.2f}x" if base else "-"
        peaks = [x for x in s["per_round_peak_rss_mib"] if x is not None]
        ok = [r for r in runs[mode] if "error" not in r]
        accuracy = ", ".join(f"{x:.2f}" for x in s.get("rewards/accuracies", []) if x is not None) or "-"
        losses = [x for x in s["train_loss"] if x is not None]
        loss = f"{statistics.mean(losses):.4f}" if losses else "-"
        print(f"| {mode} | {ok[0]['real_tokens']} | {spread(tps, '{:.0f}')} | {ratio} | {spread(peaks, '{:.0f}')} | {accuracy} | {loss} |")


# ---------------------------------------------------------------- child side (loaded by _common.worker)


def run(p: dict, probe) -> dict:
    """One run of `p["method"]` from the shared erniekit-lite benchmark recipe (runners/erniekit.py) plus the
    method's `train:` keys, through the module `erniekit-lite train` dispatches to."""
    import contextlib
    import io

    sys.path.insert(0, str(BENCH / "runners"))
    import erniekit as base  # noqa: E402 (runners/erniekit.py)

    from erniekit_lite.recipe import from_dict

    if p["method"] == "dpo":
        from erniekit_lite.train.dpo import run as train
    else:
        from erniekit_lite.train.reference_free import run as train
    raw = base.recipe_dict(p)
    raw["train"].update(p["train"])
    recipe = from_dict(raw, source="benchmarks/preference_methods.py")
    lines: list[str] = []
    with contextlib.nullcontext() if p.get("verbose") else contextlib.redirect_stdout(io.StringIO()):
        out = train(recipe, log=print if p.get("verbose") else lines.append)
    results = json.loads((Path(out) / "train_results.json").read_text())
    extra = {"reported": {"erniekit tokens/s": results["train_tokens_per_second"]}, "notes": [],
             "rewards/accuracies": results.get("rewards/accuracies"), "rewards/margins": results.get("rewards/margins")}
    if results["train_tokens"] != probe.real:  # two counts of the same batches; they must agree
        extra["notes"].append(f"erniekit-lite counted {results['train_tokens']} real tokens, the probe {probe.real}")
    return extra


if __name__ == "__main__":
    sys.exit(main())
