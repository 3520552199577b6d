"""Merge a LoRA output dir into its base and save a plain transformers checkpoint.

The result loads with `AutoModelForCausalLM.from_pretrained` alone (no peft). transformers 5 saves the MoE's fused
routed experts back in the released per-expert layout (`mlp.experts.N.gate_proj.weight`), which serving engines
expect. Weights are saved in the base checkpoint's dtype. A QLoRA run's adapter is merged into the base it trained
against: quantized to NF4 and dequantized again (exactly what the 4-bit layers computed with, the routed experts' too), its other weights in
the run's `model.dtype`; merged into the original weights it would answer differently from the trained model.

Tensors of the base checkpoint that the model class does not load (the 21B-A3B's multi-token-prediction block,
`model.mtp_*`) are copied through unchanged into a shard of their own and listed in the index, so engines that
read them (vLLM's `ernie_mtp` speculative decoding) find them in the merged model as in the base.
"""

from __future__ import annotations

import json
from pathlib import Path

from erniekit_lite.errors import UserError
from erniekit_lite.model.load import load_model, load_tokenizer
from erniekit_lite.model.source import adapter_base, trained_in_4bit
from erniekit_lite.files import staged

MARKER = "erniekit_merged.json"  # written last: a dir holding it is a complete merge
CARRIED = "model-carried-over.safetensors"  # base tensors the model class did not load, copied unchanged
INDEX = "model.safetensors.index.json"


def base_dtype(path: str) -> str:
    """The dtype the base checkpoint was saved in (float32 when its config doesn't say)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    dtype = str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "float32"


def merge(adapter_dir: str, out_dir: str, overwrite: bool = False, log=print) -> Path:
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
    with staged(out, "merging") as staging:
        qlora_dtype = trained_in_4bit(adapter_dir)
        # A reward model's adapter (method: rm) goes onto the reward class: the base's body and the trained `score` head
        model_class = reward_class(adapter_dir)
        if qlora_dtype:
            # QLoRA: the adapter learned against the 4-bit base, its other weights in the run's model.dtype. It is merged
            # into that base dequantized (what the 4-bit model computes with), not into the original weights, so the
            # merged model answers as the run did; saved in that dtype
            from erniekit_lite.model.expert_4bit import unquantize_experts
            from erniekit_lite.model.lora import load_adapter

            four_bit = load_model(base, qlora_dtype, "sdpa", load_in_4bit=True, model_class=model_class)
            unquantize_experts(four_bit)  # the NF4 routed experts (model/expert_4bit.py), which transformers doesn't know
            model = load_adapter(four_bit.dequantize(), adapter_dir, trainable=False)
        else:
            model = load_model(adapter_dir, base_dtype(base), "sdpa", trainable_adapter=False, model_class=model_class)
        merged = model.merge_and_unload()
        merged.config.use_cache = True  # the loader turns the cache off for packed training; inference wants it
        merged.save_pretrained(staging, max_shard_size="5GB")
        tokenizer_dir = adapter_dir if (Path(adapter_dir) / "tokenizer_config.json").is_file() else base
        load_tokenizer(tokenizer_dir).save_pretrained(staging)
        if getattr(merged, "generation_config", None) is not None:  # a reward model has none
            merged.generation_config.save_pretrained(staging)
        from erniekit_lite.model.vl import is_vl, processor_for

        if is_vl(merged.config):  # ERNIE-4.5-VL: its image processor goes with it
            processor_for(adapter_dir).save_pretrained(staging)
        # a reward model has no LM head: the base's is never carried into it
        carried = carry_over(base, staging, tied=bool(getattr(merged.config, "tie_word_embeddings", False)) or model_class is not None)
        (staging / MARKER).write_text(json.dumps({"adapter": str(adapter_dir), "base": base, "dequantized_4bit": qlora_dtype is not None,
                                                  "carried_over": carried}) + "\n")
    if carried:
        shown = ", ".join(carried[:3]) + (f", ... ({len(carried)} in all)" if len(carried) > 3 else "")
        log(f"merge: copied {len(carried)} tensor(s) of the base that the model class does not load, unchanged, into {CARRIED}: {shown}")
    return out


def reward_class(adapter_dir: str):
    """`model.reward.AutoRewardModel` for a reward model's adapter, else None (a causal LM)."""
    from erniekit_lite.model.reward import AutoRewardModel, is_reward_run

    return AutoRewardModel if is_reward_run(adapter_dir) else None


def base_files(base: str) -> list[Path]:
    """The base checkpoint's safetensors files: a local dir's, or the Hub snapshot `from_pretrained` just cached."""
    local = Path(base)
    if not local.is_dir():
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(base, allow_patterns=["*.safetensors", INDEX]))
    return sorted(local.glob("*.safetensors"))


def carry_over(base: str, saved: Path, tied: bool) -> list[str]:
    """Copy the base's tensors that `saved` lacks (the model class never loaded them) into `saved`; their names.

    A tied `lm_head.weight` is the embedding under another name: never carried.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    have = set()
    for path in saved.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            have.update(f.keys())
    tensors = {}
    for path in base_files(base):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                if name not in have and not (tied and name == "lm_head.weight"):
                    tensors[name] = f.get_tensor(name)
    if not tensors:
        return []
    save_file(tensors, saved / CARRIED, metadata={"format": "pt"})
    # One index over every shard, so engines that follow the index read the carried shard too
    index_path = saved / INDEX
    index = json.loads(index_path.read_text()) if index_path.is_file() else {"metadata": {}, "weight_map": {}}
    if not index["weight_map"]:  # one model.safetensors: its tensors are listed too
        for path in saved.glob("*.safetensors"):
            if path.name != CARRIED:
                with safe_open(path, "pt") as f:
                    index["weight_map"].update(dict.fromkeys(f.keys(), path.name))
                    index["metadata"]["total_size"] = sum(_nbytes(f.get_slice(k)) for k in f.keys())
    index["weight_map"].update(dict.fromkeys(tensors, CARRIED))
    index["metadata"]["total_size"] = index["metadata"].get("total_size", 0) + sum(t.nbytes for t in tensors.values())
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return sorted(tensors)


_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


def _nbytes(tensor_slice) -> int:
    """A stored tensor's size, from its header (nothing is read)."""
    import math

    return math.prod(tensor_slice.get_shape()) * _BYTES.get(tensor_slice.get_dtype(), 1)
