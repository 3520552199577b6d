"""Supervised fine-tuning, read top to bottom: check the run dir, tokenize and pack, load the model, train, save."""

from __future__ import annotations

import json
from pathlib import Path

from erniekit_lite import hub
from erniekit_lite.data.collate import PackedCollator, PaddedCollator
from erniekit_lite.data.prepare import PreparedData, prepare
from erniekit_lite.model.load import load_tokenizer
from erniekit_lite.recipe import Recipe
from erniekit_lite.train import callbacks, distribution, rundir
from erniekit_lite.train.common import load_for_training, rows_dataset, tokenizer_path, plan_lm_head, training_args, watch_moe


def run(recipe: Recipe, log=print) -> Path:
    args = training_args(recipe, Path(recipe.output.dir), log)
    rundir.check(recipe)  # fail before any slow step
    hub.check(recipe)
    tokenizer = load_tokenizer(tokenizer_path(recipe.model.path), recipe.model.trust_remote_code)
    data = prepare(recipe.data, tokenizer, seed=args.seed, log=log)
    log(describe_data(data))

    model = load_for_training(recipe, log)

    # Claimed only now, so a recipe or data mistake never leaves a half-made run dir behind
    out = rundir.claim(recipe, log)
    trainer = build_trainer(model, tokenizer, args, data, recipe)
    plan_lm_head(trainer, recipe, log)
    distribution.report(trainer, log)
    expert_load = watch_moe(trainer, recipe, log)
    result = callbacks.train(trainer, out, args.resume_from_checkpoint)
    metrics = {**result.metrics, **trainer.throughput(result.metrics["train_runtime"]), "train_samples": len(data.train.samples),
               "distributed": trainer.distribution}
    if data.eval is not None:
        metrics.update(trainer.evaluate())
    callbacks.save_final(trainer, out, metrics, expert_load)
    log(f"done: loss {metrics['train_loss']:.4f}, {metrics['train_tokens_per_second']:.0f} real tokens/s, "
        f"packing efficiency {metrics['packing_efficiency']:.1%}; saved to {out}")
    if recipe.output.sample_prompts:
        # Every process generates (a sharded model's forward is collective); the main one writes
        write_samples(trainer.model, tokenizer, recipe, out if trainer.is_world_process_zero() else None, log)
    if trainer.is_world_process_zero():
        hub.after_training(out, recipe, log)  # loss.png and model card; the push when the recipe has hub:
    callbacks.finished(out, trainer.state)
    return out


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


def write_samples(model, tokenizer, recipe: Recipe, out: Path | None, log=print) -> None:
    """Answer the sample prompts; save them to `out`/samples.jsonl unless `out` is None."""
    from erniekit_lite.generate import answer

    lines = []
    for prompt in recipe.output.sample_prompts:
        text = answer(model, tokenizer, prompt, system=recipe.data.system)
        log(f"sample> User: {prompt}\nsample> Assistant: {text}")
        lines.append(json.dumps({"prompt": prompt, "answer": text}, ensure_ascii=False) + "\n")
    if out is not None:
        (out / "samples.jsonl").write_text("".join(lines), encoding="utf-8")
