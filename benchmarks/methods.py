"""Every training method on one small LoRA run: real tokens/s and peak RSS, next to DPO's.

    python benchmarks/methods.py [--steps 4] [--batch 2] [--max-length 1024] [--rounds 3] [--samples 80]
                                 [--modes sft,pt,dpo,kto,orpo,simpo,rm,sft-peft,dpo-peft] [--threads N]

Setup (every method; benchmarks/_common.py and runners/erniekit.py): the tiny random ERNIE 4.5 dense model (hidden
256, 4 layers, the REAL 101k-token tokenizer), written once; LoRA r16 (alpha 32) on the seven projections; fp32;
`packed_sdpa`; no activation checkpointing; learning rate 1e-4; seed 0. Every method reads the same material, the
first `--samples` records of LLaMA-Factory's dpo_en_demo (sharegpt preference format), in its own form:
- dpo, orpo, simpo, rm: the pairs as they are, packed whole into padding-free rows of up to 2 x max_length tokens;
- kto: each pair as two labelled completions (chosen: desirable, rejected: undesirable), rows of examples and
  their KL twins (up to 2 x max_length);
- sft: each prompt with its chosen answer (sharegpt), max_length 2 x `--max-length`, so rows hold as many tokens;
- pt: each conversation's text (turns and the chosen answer, blank-line separated) as one document, pieces of
  2 x `--max-length` tokens.
Every method trains `--batch` packed rows per step for `--steps` steps. `sft-peft` and `dpo-peft` (not run unless
named) are sft and dpo with the adapters through peft's own Linear forward, the fused LoRA path
(model/fused_lora.py) switched off: whether fusing pays on this CPU. Settings: dpo sigmoid, beta 0.1, its
reference the policy with the adapter disabled (a no-grad forward of the same rows every step); kto beta 0.1 (KL
twins scored without grad, reference as dpo); orpo beta 0.1; simpo beta 2.0, simpo_gamma 1.0, cpo_alpha 0; rm:
TRL's RewardTrainer (score head trained in full).

Metric (the probe of benchmarks/_common.py): real tokens that the training steps forwarded with gradient (both
sides of a pair, prompts included; KTO's examples, not their KL twins, which are checked against erniekit-lite's
own count), over the wall clock of `Trainer.train()`; reference and KL passes are not counted as tokens, so their
cost is in the figure. Peak RSS: VmHWM of the run's own child process. Each method runs once per round, the methods
interleaved; the table gives min / median / max over the rounds.

This file is also the child's runner: `_common.worker` loads `runners/<name>.py`, and `../methods` names this
file, whose `run` trains through the method's own module (the CLI's dispatch).
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

MODES = ["sft", "pt", "dpo", "kto", "orpo", "simpo", "rm", "sft-peft", "dpo-peft"]
DEFAULT = MODES[:7]  # the -peft twins run when named
PAIRS = ("dpo", "orpo", "simpo", "rm")  # read the pairs as they are
TRAIN = {"sft": {}, "pt": {}, "dpo": {}, "kto": {"beta": 0.1}, "orpo": {"beta": 0.1},  # dpo: runners/erniekit.py's
         "simpo": {"beta": 2.0, "simpo_gamma": 1.0}, "rm": {}}
DATA_FORMAT = {"sft": "sharegpt", "pt": None, "dpo": "sharegpt", "kto": "sharegpt", "orpo": "sharegpt", "simpo": "sharegpt",
               "rm": "sharegpt", "sft-peft": "sharegpt", "dpo-peft": "sharegpt"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_common_args(p, steps=4, batch=2, samples=80, modes=DEFAULT, lf=False)
    return p.parse_args(argv)


def write_forms(records: list[dict], tmp: Path) -> dict[str, Path]:
    """The pair records in each method's form (see the module docstring); the path each method reads."""
    def text(turn) -> str:
        return turn["value"]

    sft = [{"conversations": r["conversations"] + [r["chosen"]]} for r in records]
    kto = [{"conversations": r["conversations"] + [side], "label": label}
           for r in records for side, label in ((r["chosen"], True), (r["rejected"], False))]
    pt = [{"text": "\n\n".join(text(t) for t in r["conversations"] + [r["chosen"]])} for r in records]
    paths = {"pairs": tmp / "data" / "pairs.json", "sft": tmp / "data" / "sft.json", "kto": tmp / "data" / "kto.json",
             "pt": tmp / "data" / "pt.jsonl"}
    paths["pairs"].write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    paths["sft"].write_text(json.dumps(sft, ensure_ascii=False), encoding="utf-8")
    paths["kto"].write_text(json.dumps(kto, ensure_ascii=False), encoding="utf-8")
    paths["pt"].write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in pt), encoding="utf-8")
    forms = {m: paths["pairs" if m in PAIRS else m] for m in DEFAULT}
    return {**forms, "sft-peft": forms["sft"], "dpo-peft": forms["dpo"]}


def method(mode: str) -> str:
    return mode.removesuffix("-peft")


def max_length(mode: str, args) -> int:
    mode = method(mode)
    # Pair and KTO rows hold two sequences of up to max_length each; sft/pt rows one sample or piece: the same row size
    return args.max_length if mode in PAIRS or mode == "kto" else 2 * args.max_length


def main(argv=None) -> int:
    args = parse_args(argv)
    args.lf_python = None
    modes = C.selected_modes(args, MODES)
    t_start, load_start, revision = time.perf_counter(), os.getloadavg()[0], C.git_revision()
    demo = C.demo_file(args.shared, "dpo_en_demo.json")

    C.quiet_transformers()
    versions = C.versions(sys.executable)
    with tempfile.TemporaryDirectory(prefix="erniekit-bench-methods-") as tmp:
        tmp = Path(tmp)
        model_dir = C.write_model(tmp, args)
        records = C.write_records(demo, tmp / "data" / "demo.json", args.samples)
        data = write_forms(records, tmp)

        def spec(mode: str, rnd: int):
            return sys.executable, "../methods", {
                "model_dir": str(model_dir), "data_path": str(data[mode]), "data_format": DATA_FORMAT[mode],
                "out_dir": str(tmp / f"run-{mode}-{rnd}"), "max_length": max_length(mode, args), "lora_r": args.lora_r,
                "method": method(mode), "peft_lora": mode.endswith("-peft"), "packing": True, "batch": args.batch,
                "steps": args.steps, "beta": 0.1, "loss_type": "sigmoid", "train": TRAIN[method(mode)], "verbose": args.verbose}

        for line in C.describe_header(f"Every method, one small LoRA run each (erniekit-lite, packed rows); tiny ERNIE 4.5 dense "
                                      f"(hidden {args.hidden_size}, {args.layers} layers, real tokenizer), LoRA r{args.lora_r} x7, "
                                      f"fp32, packed_sdpa, rows of up to {2 * args.max_length} tokens", args, versions, None):
            print(line)
        print(f"git: {revision}; rounds: {args.rounds} (methods interleaved, each run in its own process)")
        print(f"data: the first {len(records)} dpo_en_demo records in each method's form; every method: {args.batch} rows/step x "
              f"{args.steps} steps")
        print("settings: dpo sigmoid beta 0.1 (reference: adapter disabled); kto beta 0.1 (reference as dpo); orpo beta 0.1; "
              "simpo beta 2.0, simpo_gamma 1.0, cpo_alpha 0; rm RewardTrainer defaults", flush=True)
        runs = C.run_modes(modes, spec, tmp, args)

    summary, _ = C.summarise_modes(runs, "dpo")
    print()
    table(summary, runs)
    print()
    print("real tokens/s: the probe's real tokens (forwarded with gradient, prompts included) over the wall clock of "
          "Trainer.train(), per round; peak RSS: VmHWM of the run's process; x dpo: median over dpo's median. The machine "
          "may be shared: see the load average below.")
    C.print_tail(benchmark="methods",
                 config={"hidden_size": args.hidden_size, "layers": args.layers, "lora_r": args.lora_r, "max_length": args.max_length,
                         "records": len(records), "rounds": args.rounds, "steps": args.steps, "rows_per_step": args.batch,
                         "threads": args.threads, "train": TRAIN},
                 summary=summary, baseline="dpo" if "dpo" in summary and "error" not in summary["dpo"] else None, extra={},
                 notes=[], started=(t_start, load_start, revision), main_versions=versions, lf_versions=None)
    return 0


def spread(values: list[float], fmt: str) -> str:
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values))) if values else "-"


def table(summary: dict, runs: dict) -> None:
    base = summary.get("dpo", {}).get("per_round_real_tokens_per_second")
    print("| method | real tokens per run | real tokens/s min / median / max | x dpo (median) | peak RSS MiB min / median / max "
          "| train loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode, s in summary.items():
        if "error" in s:
            print(f"| {mode} | FAILED: {s['error'].replace('|', '/')} | | | | |")
            continue
        tps = s["per_round_real_tokens_per_second"]
        ratio = f"{statistics.median(tps) / statistics.median(base):.2f}x" if base else "-"
        peaks = [x for x in s["per_round_peak_rss_mib"] if x is not None]
        ok = [r for r in runs[mode] if "error" not in r]
        losses = [x for x in s["train_loss"] if x is not None]
        loss = f"{statistics.mean(losses):.4f}" if losses else "-"
        print(f"| {mode} | {ok[0]['real_tokens']} | {spread(tps, '{:.0f}')} | {ratio} | {spread(peaks, '{:.0f}')} | {loss} |")


# ---------------------------------------------------------------- child side (loaded by _common.worker)


def run(p: dict, probe) -> dict:
    """One run of `p["method"]` from the shared erniekit-lite benchmark recipe (runners/erniekit.py) plus the
    method's `train:` keys, through the module `erniekit-lite train` dispatches to."""
    import contextlib
    import io

    sys.path.insert(0, str(BENCH / "runners"))
    import erniekit as base  # noqa: E402 (runners/erniekit.py)

    from erniekit_lite.recipe import from_dict

    from erniekit_lite.train import method_runner

    train = method_runner(p["method"])
    if p.get("peft_lora"):
        from erniekit_lite.model import fused_lora

        fused_lora.fuse = lambda model: (0, {})  # every adapter keeps peft's forward (this child process only)
    raw = base.recipe_dict(p)
    raw["train"].update(p["train"])
    if p["data_format"] is None:
        del raw["data"]["train"][0]["format"]  # pt: detected from the `text` field
    recipe = from_dict(raw, source="benchmarks/methods.py")
    lines: list[str] = []
    with contextlib.nullcontext() if p.get("verbose") else contextlib.redirect_stdout(io.StringIO()):
        out = train(recipe, log=print if p.get("verbose") else lines.append)
    results = json.loads((Path(out) / "train_results.json").read_text())
    extra = {"reported": {"erniekit tokens/s": results["train_tokens_per_second"]}, "notes": []}
    # Two counts of the same batches; they must agree, but for KTO's KL twins, which erniekit-lite counts and the probe
    # (gradient-side `input_ids` only) does not
    if results["train_tokens"] != probe.real and not (p["method"] == "kto" and results["train_tokens"] > probe.real):
        extra["notes"].append(f"erniekit-lite counted {results['train_tokens']} real tokens, the probe {probe.real}")
    return extra


if __name__ == "__main__":
    sys.exit(main())
