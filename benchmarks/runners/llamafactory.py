"""One LLaMA-Factory run, through its own training entry (`llamafactory.train.tuner.run_exp`), in ITS OWN venv.

    /path/to/lf-venv/bin/python benchmarks/runners/llamafactory.py MODEL_DIR DATA.json OUT_DIR --stage sft|dpo [--neat-packing]
    /path/to/lf-venv/bin/python benchmarks/runners/llamafactory.py --moe-spec SPEC.json   # benchmarks/moe_lora.py's row

This file imports nothing from erniekit-lite; LLaMA-Factory is never a dependency of erniekit-lite.

- The records file is registered through a `dataset_info.json` in a fresh dataset dir (alpaca columns for SFT;
  sharegpt `ranking: true` with conversations/chosen/rejected for DPO), so LLaMA-Factory reads the very records the
  other modes read.
- template `ernie_nothink`: LLaMA-Factory 0.9.5's template that matches ERNIE 4.5's released chat format
  (`<|begin_of_sentence|>` + `{system}\\n` + `User: {q}\\nAssistant: ` + `{a}<|end_of_sentence|>`). Its `ernie`
  template is the ChatML-style `<|im_start|>` format of the ERNIE 4.5 *thinking* models, with a think_mode system
  prompt, and does not match the 0.3B / 21B-A3B chat template.
- finetuning_type lora, lora_rank 16 (alpha 32, dropout 0) on the seven projections; cutoff_len 1024; fp32 (no
  bf16 / fp16); `flash_attn: sdpa`; `disable_gradient_checkpointing: true` (LLaMA-Factory checkpoints by default;
  no mode here does); learning rate 1e-4; seed 0; report_to none; no saves during training (the adapter is saved
  once after training, as LLaMA-Factory always does). SFT: per-device batch 8, `neat_packing` on or off (on: its
  greedy-knapsack rows of cutoff_len tokens, pad-filled, with a block-diagonal 4-D mask under sdpa). DPO: batch 4
  pairs, sigmoid loss, beta 0.1, reference = the base with the adapter disabled.
- `include_effective_tokens_per_second: true`: LLaMA-Factory's own figure (its `effective_tokens_per_sec`: every
  input_ids length in the whole prepared dataset x epochs / train_runtime), reported beside the probe's count.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lf_args(p: dict) -> dict:
    out = Path(p["out_dir"])
    dataset_dir = out.parent / f"{out.name}-dataset"
    dataset_dir.mkdir(parents=True, exist_ok=True)
    if p["stage"] == "dpo":
        entry = {"file_name": str(Path(p["data_path"]).resolve()), "ranking": True, "formatting": "sharegpt",
                 "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}}
    else:
        entry = {"file_name": str(Path(p["data_path"]).resolve())}  # alpaca: instruction / input / output
    (dataset_dir / "dataset_info.json").write_text(json.dumps({"bench_data": entry}))
    args = {
        "stage": p["stage"],
        "do_train": True,
        "model_name_or_path": p["model_dir"],
        "flash_attn": "sdpa",
        "disable_gradient_checkpointing": True,
        "finetuning_type": "lora",
        "lora_rank": p["lora_r"],
        "lora_alpha": 2 * p["lora_r"],
        "lora_dropout": 0.0,
        "lora_target": ",".join(LORA_TARGETS),
        "dataset": "bench_data",
        "dataset_dir": str(dataset_dir),
        "template": "ernie_nothink",
        "cutoff_len": p["max_length"],
        "overwrite_cache": True,
        "output_dir": str(out),
        "overwrite_output_dir": True,
        "per_device_train_batch_size": p["batch"],
        "gradient_accumulation_steps": 1,
        "max_steps": p["steps"],
        "learning_rate": 1e-4,
        "logging_steps": p["steps"],
        "save_strategy": "no",
        "report_to": "none",
        "bf16": False,
        "fp16": False,
        "seed": 0,
        "disable_tqdm": True,
        "plot_loss": False,
        "include_effective_tokens_per_second": True,
        "dataloader_num_workers": 0,
    }
    if p["stage"] == "dpo":
        args.update({"pref_beta": p["beta"], "pref_loss": p["loss_type"]})
    else:
        args["neat_packing"] = bool(p.get("neat_packing"))
    return args


def stub_torchaudio() -> bool:
    """LLaMA-Factory 0.9.5 imports torchaudio at module level (`data/mm_plugin.py`) and lists it as a requirement,
    but torchaudio has no release for torch 2.13 (PyPI's newest is 2.11), so a venv pinned to torch 2.13 may lack
    it. Text-only training never calls it: an empty stand-in module lets LLaMA-Factory import. Returns True when
    the stand-in was needed (reported as a note); the venv itself is left untouched."""
    import importlib.machinery
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("torchaudio") is not None:
        return False
    stub = types.ModuleType("torchaudio")
    stub.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)  # find_spec must not fail on it
    sys.modules["torchaudio"] = stub
    return True


def train(p: dict) -> bool:
    stubbed = stub_torchaudio()
    from llamafactory.train.tuner import run_exp

    run_exp(lf_args(p))
    return stubbed


def run(p: dict, probe) -> dict:
    """Benchmark entry (benchmarks/_common.py): the probe times and counts; LF's effective_tokens_per_sec is reported.

    LF's workflow adds `effective_tokens_per_sec` to the very metrics dict of the TrainOutput the probe kept."""
    stubbed = train(p)
    metrics = (probe.output.metrics if probe.output is not None else None) or {}
    extra = {"reported": {}, "notes": ["torchaudio missing from the LLaMA-Factory venv: stubbed (text-only)"] if stubbed else []}
    if "effective_tokens_per_sec" in metrics:
        extra["reported"]["LF effective_tokens_per_sec"] = round(metrics["effective_tokens_per_sec"], 2)
    if probe.trainer is not None:
        rewards = [h for h in probe.trainer.state.log_history if "rewards/accuracies" in h]
        for key in ("rewards/accuracies", "rewards/margins"):
            if rewards and key in rewards[-1]:
                extra[key] = rewards[-1][key]
    return extra


def moe_step_times(spec_path: str) -> int:
    """benchmarks/moe_lora.py's LLaMA-Factory row: LoRA SFT (LLaMA-Factory's default `lora_target: all`) on the saved
    random MoE model, over the very packed row the other rows train on, fed as a pre-tokenized dataset
    (`tokenized_path`; its parser still asks for a dataset name, never read): input_ids, labels = input_ids, attention_mask = each token's sample number (1..4), which
    `neat_packing` turns into its block-diagonal 4-D mask. Batch 1, fp32, sdpa, no gradient checkpointing. Writes step
    times (after the warm-up), losses, which modules got adapters, trainable parameters and VmHWM to spec["result"]."""
    import re
    import time

    spec = json.loads(Path(spec_path).read_text())
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    stubbed = stub_torchaudio()
    from datasets import Dataset
    from llamafactory.train.tuner import run_exp

    tmp = Path(spec["out_dir"])
    row = spec["row"]
    n = spec["warmup"] + spec["steps"]
    Dataset.from_dict({"input_ids": [row["input_ids"]] * n, "attention_mask": [row["segments"]] * n,
                       "labels": [row["input_ids"]] * n}).save_to_disk(str(tmp / "tokenized"))
    from transformers import TrainerCallback

    adapted, trainable = set(), []

    class StepTimer(TrainerCallback):
        """Each optimizer step's wall clock (forward, backward, optimizer step, zero_grad, as moe_lora.py's own loop
        times it), the logged losses, and what LLaMA-Factory put adapters on (layer numbers dropped)."""

        def __init__(self):
            self.times, self.losses, self.t = [], [], None

        def on_train_begin(self, args, state, control, model=None, **kw):
            adapted.update(re.sub(r".*layers\.\d+\.", "", name) for name, m in model.named_modules() if hasattr(m, "lora_A"))
            trainable.append(sum(p.numel() for p in model.parameters() if p.requires_grad))

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(round(float(logs["loss"]), 4))

    timer = StepTimer()
    t0 = time.perf_counter()
    run_exp({
        "stage": "sft", "do_train": True, "model_name_or_path": spec["model_dir"], "flash_attn": "sdpa",
        "disable_gradient_checkpointing": True, "finetuning_type": "lora", "lora_rank": spec["lora_r"],
        "lora_alpha": 2 * spec["lora_r"], "lora_dropout": 0.0, "lora_target": "all", "template": "ernie_nothink",
        "tokenized_path": str(tmp / "tokenized"), "dataset": "unused", "neat_packing": True, "cutoff_len": len(row["input_ids"]),
        "output_dir": str(tmp / "out"), "overwrite_output_dir": True, "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 1, "max_steps": n, "learning_rate": 1e-4, "lr_scheduler_type": "constant",
        "warmup_steps": 0, "logging_steps": 1, "save_strategy": "no", "report_to": "none", "bf16": False, "fp16": False,
        "seed": 0, "disable_tqdm": True, "plot_loss": False, "dataloader_num_workers": 0,
    }, callbacks=[timer])
    hwm = next((int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmHWM:")), None)
    Path(spec["result"]).write_text(json.dumps({
        "step_seconds": [round(t, 3) for t in timer.times[spec["warmup"]:]], "warmup_seconds": round(sum(timer.times[:spec["warmup"]]), 3),
        "losses": timer.losses, "tokens_per_step": len(row["input_ids"]), "adapted": sorted(adapted),
        "trainable_params": trainable[0] if trainable else None, "peak_rss_mib": round(hwm / 1024, 1) if hwm else None,
        "threads": torch.get_num_threads(), "wall_seconds": round(time.perf_counter() - t0, 1),
        "notes": ["torchaudio missing from the LLaMA-Factory venv: stubbed (text-only)"] if stubbed else []}))
    return 0


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--moe-spec":  # benchmarks/moe_lora.py's LLaMA-Factory row
        here = Path(__file__).resolve().parent  # this file's folder first on the path would shadow the package's name
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
        sys.exit(moe_step_times(sys.argv[2]))

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("data_path")
    ap.add_argument("out_dir")
    ap.add_argument("--stage", choices=["sft", "dpo"], default="sft")
    ap.add_argument("--neat-packing", action="store_true")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=None, help="default: 8 (sft) or 4 (dpo)")
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    train({"model_dir": a.model_dir, "data_path": a.data_path, "out_dir": a.out_dir, "stage": a.stage, "neat_packing": a.neat_packing,
           "max_length": a.max_length, "batch": a.batch or (4 if a.stage == "dpo" else 8), "steps": a.steps, "lora_r": 16,
           "beta": 0.1, "loss_type": "sigmoid"})
