"""Preference tuning (DPO and TRL's other pairwise losses), read top to bottom like `sft.py`."""

from __future__ import annotations

from pathlib import Path

from erniekit_lite import hub
from erniekit_lite.data.pairs import PackedPairCollator, PaddedPairCollator
from erniekit_lite.data.prepare import PreparedPairs, prepare_pairs
from erniekit_lite.model.load import load_tokenizer
from erniekit_lite.recipe import Recipe
from erniekit_lite.train import callbacks, distribution, rundir
from erniekit_lite.train.common import describe_model, load_for_training, rows_dataset, tokenizer_path, plan_lm_head, training_args, watch_moe


def run(recipe: Recipe, log=print) -> Path:
    args = training_args(recipe, Path(recipe.output.dir), log)
    rundir.check(recipe)
    hub.check(recipe)
    tokenizer = load_tokenizer(tokenizer_path(recipe.model.path), recipe.model.trust_remote_code)
    data = prepare_pairs(recipe.data, tokenizer, seed=args.seed, log=log)
    log(describe_pairs(data))
    # A new adapter is handed to TRL as a config: its reference is then the base with the adapter disabled
    # (no copy). A LoRA run dir given as model.path keeps its adapter, and TRL copies it as the reference.
    model = load_for_training(recipe, log, apply_lora=False)

    out = rundir.claim(recipe, log)
    trainer = build_trainer(model, tokenizer, args, data, recipe)
    plan_lm_head(trainer, recipe, log)
    distribution.report(trainer, log)
    expert_load = watch_moe(trainer, recipe, log)
    if recipe.lora is not None:
        log(describe_model(trainer.model))
    result = callbacks.train(trainer, out, args.resume_from_checkpoint)
    metrics = {**result.metrics, **trainer.throughput(result.metrics["train_runtime"]), **last_rewards(trainer), "train_samples": len(data.train.pairs),
               "distributed": trainer.distribution}
    if data.eval is not None:
        metrics.update(trainer.evaluate())
    callbacks.save_final(trainer, out, metrics, expert_load)
    log(
        f"done: loss {metrics['train_loss']:.4f}, reward accuracy {metrics.get('rewards/accuracies', float('nan')):.2f}, "
        f"{metrics['train_tokens_per_second']:.0f} real tokens/s, packing efficiency {metrics['packing_efficiency']:.1%}; saved to {out}"
    )
    if trainer.is_world_process_zero():
        hub.after_training(out, recipe, log)  # loss.png and model card; the push when the recipe has hub:
    callbacks.finished(out, trainer.state)
    return out


def build_trainer(model, tokenizer, args, data: PreparedPairs, recipe: Recipe):
    from erniekit_lite.train.dpo_trainer import ErnieDPOTrainer

    from erniekit_lite.model.lora import check_adapters, lora_config, targets_as_written

    collator = PackedPairCollator(recipe.data.max_length) if recipe.data.packing else PaddedPairCollator(tokenizer.pad_token_id)
    config = lora_config(model, recipe.lora) if recipe.lora is not None else None
    with targets_as_written():  # TRL calls get_peft_model itself
        trainer = ErnieDPOTrainer(
            model=model,
            args=args,
            train_dataset=rows_dataset(data.train.rows),
            eval_dataset=rows_dataset(data.eval.rows) if data.eval is not None else None,
            processing_class=tokenizer,
            data_collator=collator,
            peft_config=config,
        )
    if config is not None:
        check_adapters(trainer.model, config)
    return trainer


def last_rewards(trainer) -> dict:
    """The reward metrics of the last logged training step, for train_results.json."""
    logged = [h for h in trainer.state.log_history if "rewards/accuracies" in h and "eval_rewards/accuracies" not in h]
    keys = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
    return {k: logged[-1][k] for k in keys if logged and k in logged[-1]}


def describe_pairs(data: PreparedPairs) -> str:
    s = data.train.stats
    lines = [f"data: template {data.template}, preference pairs"]
    for src in data.train.sources:
        lines.append(f"  {src.path} [{src.format}{' (auto)' if src.detected else ''}]: {src.records} records -> {src.samples} pairs")
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(s.skipped.items())) or "none"
    lines.append(
        f"  train: {len(data.train.pairs)} pairs in {len(data.train.rows)} rows, packing efficiency "
        f"{data.train.packing_efficiency:.1%}; truncated {s.truncated}; skipped: {skipped}"
    )
    if data.eval is not None:
        lines.append(f"  eval: {len(data.eval.pairs)} pairs in {len(data.eval.rows)} rows")
    return "\n".join(lines)
