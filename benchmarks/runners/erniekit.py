"""One erniekit-lite run (main venv): `erniekit_lite.train.sft.run` or `erniekit_lite.train.dpo.run` from a recipe.

Same setup as the peers: LoRA r (alpha 2r) on the seven projections, fp32, sdpa (`packed_sdpa` for packed rows),
no activation checkpointing, learning rate 1e-4, seed 0, no saves during training. Packed or padded per
`data.packing`; erniekit-lite's own real-token figure (`train_tokens_per_second` in train_results.json) is
returned as its reported figure, beside the probe's count.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def recipe_dict(p: dict) -> dict:
    train = {
        "max_steps": p["steps"],
        "per_device_train_batch_size": p["batch"],
        "learning_rate": 1e-4,
        "logging_steps": p["steps"],  # one log, at the last step (DPO: run-mean rewards/* in train_results.json)
        "save_strategy": "no",
        "report_to": "none",
        "activation_checkpointing": False,
        "seed": 0,
        "disable_tqdm": True,
    }
    if p["method"] == "dpo":
        train.update({"beta": p["beta"], "loss_type": [p["loss_type"]]})
    return {
        "model": {"path": p["model_dir"], "dtype": "float32"},
        "method": p["method"],
        "data": {
            "train": [{"path": p["data_path"], "format": p["data_format"]}],
            "max_length": p["max_length"],
            "packing": p["packing"],
        },
        "lora": {"r": p["lora_r"], "alpha": 2 * p["lora_r"], "targets": LORA_TARGETS},
        "train": train,
        "output": {"dir": p["out_dir"]},
    }


def run(p: dict, probe) -> dict:
    from erniekit_lite.recipe import from_dict

    if p["method"] == "dpo":
        from erniekit_lite.train.dpo import run as train
    else:
        from erniekit_lite.train.sft import run as train

    recipe = from_dict(recipe_dict(p), source="benchmarks/runners/erniekit.py")
    lines: list[str] = []
    sink = contextlib.nullcontext() if p.get("verbose") else contextlib.redirect_stdout(io.StringIO())
    with sink:
        out = train(recipe, log=print if p.get("verbose") else lines.append)
    results = json.loads((Path(out) / "train_results.json").read_text())
    extra = {
        "reported": {"erniekit tokens/s": results["train_tokens_per_second"]},
        "erniekit_train_tokens": results["train_tokens"],
        "packing_efficiency": results.get("packing_efficiency"),
        "notes": [],
    }
    if results["train_tokens"] != probe.real:  # two counts of the same batches; they must agree
        extra["notes"].append(f"erniekit-lite counted {results['train_tokens']} real tokens, the probe {probe.real}")
    for key in ("rewards/accuracies", "rewards/margins"):
        if key in results:
            extra[key] = results[key]
    return extra
