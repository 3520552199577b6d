"""One LLaMA-Factory run, through its own training entry (`llamafactory.train.tuner.run_exp`), in ITS OWN venv.

    /path/to/lf-venv/bin/python benchmarks/runners/llamafactory.py MODEL_DIR DATA.json OUT_DIR --stage sft|dpo [--neat-packing]

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


if __name__ == "__main__":
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
