"""Preference tuning (DPO and TRL's other pairwise losses): what it adds to the shared run (run.py).

A new adapter is handed to TRL as a config: its reference is then the base with the adapter disabled (no copy). A
LoRA run dir given as model.path keeps its adapter, and TRL copies it as the reference. PiSSA and OLoRA take part of
each base weight into the adapter, so "the base with the adapter disabled" would no longer be the base: refused."""

from __future__ import annotations

from pathlib import Path

from erniekit_lite.data.pairs import PackedPairCollator, PaddedPairCollator
from erniekit_lite.data.prepare import PreparedPairs, describe_pairs, prepare_pairs
from erniekit_lite.recipe import Recipe
from erniekit_lite.run_plan import RunPlan
from erniekit_lite.train import run as runner
from erniekit_lite.train.common import trainer_inputs, trl_trainer, vl_trainer_inputs


def run(recipe: Recipe, log=print) -> Path:
    return runner.run(recipe, METHOD, log)


def prepare_data(data, tokenizer, seed: int = 42, log=print, beside: Path | None = None, images=None) -> PreparedPairs:
    """The recipe's pairs as rows; `images`: a VL model's image processor (image-text pairs, data/vl.py)."""
    if images is not None:
        from erniekit_lite.data.vl_rows import prepare_vl_pairs

        return prepare_vl_pairs(data, tokenizer, images, seed, log)
    return prepare_pairs(data, tokenizer, seed, log, beside)


def build_trainer(model, tokenizer, args, data: PreparedPairs, plan: RunPlan):
    from erniekit_lite.train.dpo_trainer import ErnieDPOTrainer

    if plan.vl:  # rows of image-text pairs, always laid end to end, held by the collator (data/vl_rows.py)
        from erniekit_lite.data.vl_rows import VLPackedPairCollator

        inputs = vl_trainer_inputs(data, tokenizer, plan, VLPackedPairCollator)
    else:
        inputs = trainer_inputs(data, tokenizer, plan, PackedPairCollator, PaddedPairCollator)
    return trl_trainer(ErnieDPOTrainer, model, plan, args=args, reference_cache=plan.data.cache, **inputs)


def last_rewards(trainer) -> dict:
    """The reward metrics of the last logged training step, for train_results.json."""
    logged = [h for h in trainer.state.log_history if "rewards/accuracies" in h and "eval_rewards/accuracies" not in h]
    keys = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
    return {k: logged[-1][k] for k in keys if logged and k in logged[-1]}


METHOD = runner.Method(
    prepare=prepare_data, describe=describe_pairs, build_trainer=build_trainer, trained=lambda data: len(data.train.pairs),
    adapter_by_trainer=True, metrics=last_rewards,
    summary=lambda metrics: f"reward accuracy {metrics.get('rewards/accuracies', float('nan')):.2f}, ",
)
