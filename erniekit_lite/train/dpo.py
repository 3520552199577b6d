"""Preference tuning (DPO and TRL's other pairwise losses): what it adds to the shared run (run.py).

A new adapter is handed to TRL as a config: its reference is then the base with the adapter disabled (no copy). A
LoRA run dir given as model.path keeps its adapter, and TRL copies it as the reference. PiSSA and OLoRA take part of
each base weight into the adapter, so "the base with the adapter disabled" would no longer be the base: refused."""

from __future__ import annotations

from pathlib import Path

from erniekit_lite.data.pairs import PackedPairCollator, PaddedPairCollator
from erniekit_lite.data.prepare import PreparedPairs, describe_pairs, prepare_pairs
from erniekit_lite.errors import UserError
from erniekit_lite.recipe import Recipe
from erniekit_lite.train import run as runner
from erniekit_lite.train.common import rows_dataset


def run(recipe: Recipe, log=print) -> Path:
    check_lora(recipe)  # before anything loads or the run dir is claimed
    return runner.run(recipe, METHOD, log)


def check_lora(recipe: Recipe) -> None:
    from erniekit_lite.model.lora import mutates_base

    if recipe.lora is not None and mutates_base(recipe.lora.init):
        raise UserError(f"lora.init: {recipe.lora.init} moves part of each base weight into the adapter, and DPO's reference "
                        "is the base with the adapter disabled, which would then be the changed base; use lora.init true, "
                        "gaussian, orthogonal or mica for dpo")


def build_trainer(model, tokenizer, args, data: PreparedPairs, recipe: Recipe):
    from erniekit_lite.train.dpo_trainer import ErnieDPOTrainer

    from erniekit_lite.model.lora import SETTINGS, check_adapters, lora_config, targets_as_written

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
        setattr(trainer.model, SETTINGS, recipe.lora)  # LoRA+ (train/optimizer.py) reads it
    return trainer


def last_rewards(trainer) -> dict:
    """The reward metrics of the last logged training step, for train_results.json."""
    logged = [h for h in trainer.state.log_history if "rewards/accuracies" in h and "eval_rewards/accuracies" not in h]
    keys = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
    return {k: logged[-1][k] for k in keys if logged and k in logged[-1]}


METHOD = runner.Method(
    prepare=prepare_pairs, describe=describe_pairs, build_trainer=build_trainer, trained=lambda data: len(data.train.pairs),
    adapter_by_trainer=True, metrics=last_rewards,
    summary=lambda metrics: f"reward accuracy {metrics.get('rewards/accuracies', float('nan')):.2f}, ",
)
