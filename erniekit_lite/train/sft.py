"""Supervised fine-tuning, read top to bottom: claim run dir, tokenize and pack, load model, train, save."""

from __future__ import annotations

import json
from pathlib import Path

from erniekit_lite.data.collate import PackedCollator, PaddedCollator
from erniekit_lite.data.packing import Row
from erniekit_lite.data.prepare import PreparedData, prepare
from erniekit_lite.errors import UserError
from erniekit_lite.model.load import load_model, load_tokenizer, resolve_attention
from erniekit_lite.recipe import Recipe
from erniekit_lite.train import rundir


def run(recipe: Recipe, log=print) -> Path:
    args = training_args(recipe, Path(recipe.output.dir))
    rundir.check(recipe)  # fail before any slow step
    tokenizer = load_tokenizer(_tokenizer_path(recipe.model.path), recipe.model.trust_remote_code)
    data = prepare(recipe.data, tokenizer, seed=args.seed, log=log)
    log(describe_data(data))

    attn = resolve_attention(recipe.model.attn_implementation, recipe.data.packing)
    model = load_model(recipe.model.path, recipe.model.dtype, attn, recipe.model.trust_remote_code)
    if recipe.lora is not None:
        if hasattr(model, "peft_config"):
            raise UserError("lora: model.path is already a LoRA output dir; omit lora: to keep training that adapter")
        from erniekit_lite.model.lora import apply_lora

        model = apply_lora(model, recipe.lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log(f"model: {type(model).__name__} attention={attn} trainable {trainable:,} of {total:,} parameters")

    # Claimed only now, so a recipe or data mistake never leaves a half-made run dir behind
    out = rundir.claim(recipe, log)
    trainer = build_trainer(model, tokenizer, args, data, recipe)
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = {**result.metrics, **trainer.throughput(result.metrics["train_runtime"])}
    if data.eval is not None:
        metrics.update(trainer.evaluate())
    trainer.save_model(str(out))
    tokenizer.save_pretrained(str(out))
    trainer.save_metrics("train", metrics)  # train_results.json
    trainer.save_state()  # trainer_state.json with log_history
    log(f"done: loss {metrics['train_loss']:.4f}, {metrics['train_tokens_per_second']:.0f} real tokens/s, "
        f"packing efficiency {metrics['packing_efficiency']:.1%}; saved to {out}")
    if recipe.output.sample_prompts:
        write_samples(trainer.model, tokenizer, recipe, out, log)
    return out


def training_args(recipe: Recipe, out: Path):
    import torch
    from trl import SFTConfig

    cuda = torch.cuda.is_available()
    settings = {
        "report_to": "none",
        "bf16": cuda and torch.cuda.is_bf16_supported(),  # TRL defaults to bf16, which fails on CPU
        "logging_steps": 10,
        "save_strategy": "steps",
        "save_total_limit": 2,
        "dataloader_pin_memory": cuda,
        **recipe.train,
        # owned by the recipe's own sections (see recipe.OWNED_TRAIN_KEYS)
        "output_dir": str(out),
        "max_length": recipe.data.max_length,
        "packing": False,  # we pack ourselves, exactly; TRL must not repack
        "padding_free": False,  # our collator is padding-free; TRL's flag would reject a custom collator
        "dataset_kwargs": {"skip_prepare_dataset": True},
        "remove_unused_columns": False,
        "prediction_loss_only": True,
    }
    if (settings.get("bf16") or settings.get("fp16")) and not cuda:
        key = "bf16" if settings.get("bf16") else "fp16"
        raise UserError(f"train.{key}: true needs a CUDA GPU and none was found; set train.{key}=false to train on CPU")
    try:
        return SFTConfig(**settings)
    except (ValueError, TypeError) as e:
        raise UserError(f"train: {str(e).strip().splitlines()[0]}") from None


def build_trainer(model, tokenizer, args, data: PreparedData, recipe: Recipe):
    from erniekit_lite.train.trainer import ErnieSFTTrainer

    if recipe.data.packing:
        collator = PackedCollator(recipe.data.max_length)
    else:
        collator = PaddedCollator(tokenizer.pad_token_id)
    return ErnieSFTTrainer(
        model=model,
        args=args,
        train_dataset=rows_dataset(data.train.rows),
        eval_dataset=rows_dataset(data.eval.rows) if data.eval is not None else None,
        processing_class=tokenizer,
        data_collator=collator,
    )


def rows_dataset(rows: list[Row]):
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "input_ids": [r.input_ids for r in rows],
            "labels": [r.labels for r in rows],
            "seq_lengths": [r.seq_lengths for r in rows],
        }
    )


def describe_data(data: PreparedData) -> str:
    s = data.train.stats
    lines = [f"data: template {data.template}"]
    for src in data.train.sources:
        lines.append(f"  {src.path} [{src.format}{' (auto)' if src.detected else ''}]: {src.records} records -> {src.samples} samples")
    lines.append(
        f"  train: {len(data.train.samples)} samples in {len(data.train.rows)} rows, "
        f"packing efficiency {data.train.packing_efficiency:.1%}; truncated {s.truncated}, "
        f"dropped {s.dropped_overlong} overlong and {s.dropped_untrained} without trained tokens"
    )
    if data.eval is not None:
        lines.append(f"  eval: {len(data.eval.samples)} samples in {len(data.eval.rows)} rows")
    return "\n".join(lines)


def write_samples(model, tokenizer, recipe: Recipe, out: Path, log=print) -> None:
    from erniekit_lite.generate import answer

    with open(out / "samples.jsonl", "w", encoding="utf-8") as f:
        for prompt in recipe.output.sample_prompts:
            text = answer(model, tokenizer, prompt, system=recipe.data.system)
            log(f"sample> User: {prompt}\nsample> Assistant: {text}")
            f.write(json.dumps({"prompt": prompt, "answer": text}, ensure_ascii=False) + "\n")


def _tokenizer_path(model_path: str) -> str:
    from erniekit_lite.model.load import adapter_base

    # An adapter dir saved by us carries the tokenizer; a bare adapter falls back to its base
    if adapter_base(model_path) and not (Path(model_path) / "tokenizer_config.json").is_file():
        return adapter_base(model_path)
    return model_path
