"""`validate`: check a recipe and its data without training, and describe the run it would make."""

from __future__ import annotations

import math
from pathlib import Path

from erniekit_lite.recipe import Recipe


def plan(recipe: Recipe, log=print) -> dict:
    from erniekit_lite.data.prepare import prepare, prepare_pairs
    from erniekit_lite.model.load import adapter_base, load_tokenizer
    from erniekit_lite.train.common import tokenizer_path, training_args
    from erniekit_lite.train.dpo import describe_pairs
    from erniekit_lite.train.sft import describe_data

    args = training_args(recipe, Path(recipe.output.dir))
    tokenizer = load_tokenizer(tokenizer_path(recipe.model.path), recipe.model.trust_remote_code)
    if recipe.method == "dpo":
        data = prepare_pairs(recipe.data, tokenizer, seed=args.seed, log=log)
        describe, units = describe_pairs, "pairs"
        truncated, dropped = data.train.stats.truncated, sum(data.train.stats.skipped.values())
        count = len(data.train.pairs)
    else:
        data = prepare(recipe.data, tokenizer, seed=args.seed, log=log)
        describe, units = describe_data, "samples"
        truncated = data.train.stats.truncated
        dropped = data.train.stats.dropped_overlong + data.train.stats.dropped_untrained
        count = len(data.train.samples)
    arch = architecture(adapter_base(recipe.model.path) or recipe.model.path, recipe)

    lengths = sorted(data.train.stats.lengths)
    rows = len(data.train.rows)
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)
    steps = args.max_steps if args.max_steps > 0 else math.ceil(rows / per_step) * math.ceil(args.num_train_epochs)
    info = {
        "architecture": arch["class"],
        "parameters": arch["parameters"],
        "trainable_parameters": arch["trainable"],
        f"train_{units}": count,
        "length_mean": round(sum(lengths) / len(lengths), 1),
        "length_p95": lengths[min(len(lengths) - 1, int(0.95 * len(lengths)))],
        "length_max": lengths[-1],
        "truncated": truncated,
        "dropped": dropped,
        "rows": rows,
        "packing_efficiency": round(data.train.packing_efficiency, 4),
        "optimizer_steps": steps,
    }
    log(describe(data))
    log(
        f"model: {arch['class']} ({recipe.model.path}), {arch['parameters']:,} parameters, "
        f"{arch['trainable']:,} trainable ({'LoRA r=%d' % recipe.lora.r if recipe.lora else 'full fine-tuning'})"
    )
    log(
        f"tokens per sequence: mean {info['length_mean']}, p95 {info['length_p95']}, max {info['length_max']} "
        f"(max_length {recipe.data.max_length}); {info['truncated']} truncated, {info['dropped']} dropped"
    )
    log(
        f"batches: {rows} {'packed rows' if recipe.data.packing else 'padded rows'}, packing efficiency "
        f"{info['packing_efficiency']:.1%}; {steps} optimizer steps of {per_step} rows"
    )
    return info


def architecture(path: str, recipe: Recipe) -> dict:
    """Parameter counts from the config alone: the model is built on the meta device, no weights are read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from erniekit_lite.errors import UserError

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=recipe.model.trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"model.path: {path}: could not read the model config: {str(e).strip().splitlines()[0]}") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=recipe.model.trust_remote_code)
    total = sum(p.numel() for p in model.parameters())
    trainable = total
    if recipe.lora is not None:
        from erniekit_lite.model.lora import apply_lora

        model = apply_lora(model, recipe.lora)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"class": type(model.get_base_model() if hasattr(model, "get_base_model") else model).__name__, "parameters": total, "trainable": trainable}
