"""Merge a LoRA output dir into its base and save a plain transformers checkpoint.

The result loads with `AutoModelForCausalLM.from_pretrained` alone (no peft). transformers 5 saves the MoE's fused
routed experts back in the released per-expert layout (`mlp.experts.N.gate_proj.weight`), which serving engines
expect. Weights are saved in the base checkpoint's dtype. A QLoRA run's adapter is merged into the base it trained
against: quantized to NF4 and dequantized again (exactly what the 4-bit layers computed with), its other weights in
the run's `model.dtype`; merged into the original weights it would answer differently from the trained model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from erniekit_lite.errors import UserError
from erniekit_lite.model.load import adapter_base, load_model, load_tokenizer

MARKER = "erniekit_merged.json"  # written last: a dir holding it is a complete merge


def base_dtype(path: str) -> str:
    """The dtype the base checkpoint was saved in (float32 when its config doesn't say)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    dtype = str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "float32"


def trained_in_4bit(run_dir: str) -> str | None:
    """For a QLoRA run dir (its recipe.yaml has model.load_in_4bit: true), the dtype its unquantized weights had."""
    import yaml

    recipe = Path(run_dir) / "recipe.yaml"
    if not recipe.is_file():
        return None
    model = (yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}).get("model") or {}
    return model.get("dtype", "float32") if model.get("load_in_4bit") else None


def merge(adapter_dir: str, out_dir: str, overwrite: bool = False) -> Path:
    base = adapter_base(adapter_dir)
    if base is None:
        raise UserError(f"{adapter_dir}: not a LoRA output dir (no adapter_config.json); nothing to merge")
    out = Path(out_dir)
    if out.resolve() == Path(adapter_dir).resolve():
        raise UserError(f"--out {out}: is the adapter dir itself; choose a new directory for the merged model")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"{out}: not empty; choose a new directory for the merged model, or --overwrite (nothing was written)")
        if not (out / MARKER).is_file():
            raise UserError(f"{out}: not empty and not a previous merge; --overwrite only replaces a merged model (nothing was written)")
    # Written beside the target and renamed at the end: a failed merge leaves no half-written model behind,
    # and a previous merge (replaced with --overwrite) survives until the new one is complete
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.merging")
    shutil.rmtree(staging, ignore_errors=True)
    qlora_dtype = trained_in_4bit(adapter_dir)
    if qlora_dtype:
        # QLoRA: the adapter learned against the 4-bit base, its other weights in the run's model.dtype. It is merged
        # into that base dequantized (what the 4-bit model computes with), not into the original weights, so the
        # merged model answers as the run did; saved in that dtype
        from erniekit_lite.model.lora import load_adapter

        four_bit = load_model(base, qlora_dtype, "sdpa", load_in_4bit=True)
        model = load_adapter(four_bit.dequantize(), adapter_dir, trainable=False)
    else:
        model = load_model(adapter_dir, base_dtype(base), "sdpa", trainable_adapter=False)
    merged = model.merge_and_unload()
    merged.config.use_cache = True  # the loader turns the cache off for packed training; inference wants it
    merged.save_pretrained(staging, max_shard_size="5GB")
    tokenizer_dir = adapter_dir if (Path(adapter_dir) / "tokenizer_config.json").is_file() else base
    load_tokenizer(tokenizer_dir).save_pretrained(staging)
    if merged.generation_config is not None:
        merged.generation_config.save_pretrained(staging)
    (staging / MARKER).write_text(json.dumps({"adapter": str(adapter_dir), "base": base, "dequantized_4bit": qlora_dtype is not None}) + "\n")
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out
