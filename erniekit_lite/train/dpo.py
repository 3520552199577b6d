"""Preference tuning (DPO with every loss type of TRL's, dpo_loss.py): what it adds to the shared run (run.py).

A new adapter's reference is the base with the adapter disabled (no copy); a LoRA run dir given as model.path keeps
its adapter, and a frozen copy of it is the reference; full fine-tuning keeps a frozen copy of the model, or
precomputes (reference.py). PiSSA and OLoRA take part of each base weight into the adapter, so "the base with the
adapter disabled" would no longer be the base: refused."""

from __future__ import annotations

from pathlib import Path

from erniekit_lite.data.pairs import PackedPairCollator, PaddedPairCollator
from erniekit_lite.data.prepare import PreparedPairs, describe_pairs, prepare_pairs
from erniekit_lite.recipe import Recipe
from erniekit_lite.run_plan import RunPlan
from erniekit_lite.train import run as runner
from erniekit_lite.train.common import trainer_inputs, vl_trainer_inputs


def run(recipe: Recipe, log=print) -> Path:
    return runner.run(recipe, METHOD, log)


def prepare_data(data, tokenizer, seed: int = 42, log=print, beside: Path | None = None, images=None) -> PreparedPairs:
    """The recipe's pairs as rows; `images`: a VL model's image processor (image-text pairs, data/vl.py)."""
    if images is not None:
        from erniekit_lite.data.vl_rows import prepare_vl_pairs

        return prepare_vl_pairs(data, tokenizer, images, seed, log)
    return prepare_pairs(data, tokenizer, seed, log, beside)


def build_trainer(model, tokenizer, args, data: PreparedPairs, plan: RunPlan):
    from erniekit_lite.train.dpo_loss import DPOLoss
    from erniekit_lite.train.reference import trainer_with

    if plan.vl:  # rows of image-text pairs, always laid end to end, held by the collator (data/vl_rows.py)
        from erniekit_lite.data.vl_rows import VLPackedPairCollator

        inputs = vl_trainer_inputs(data, tokenizer, plan, VLPackedPairCollator)
    else:
        inputs = trainer_inputs(data, tokenizer, plan, PackedPairCollator, PaddedPairCollator)
    return trainer_with(model, args, plan, inputs, lambda aux, reference: DPOLoss(args, aux, reference), _reference_columns,
                        per_row=lambda row: len(row["seq_lengths"]) // 2,
                        settings={"method": "dpo", "ld_alpha": args.ld_alpha})


def _reference_columns(loss, model, batch: dict) -> dict:
    from erniekit_lite.train.dpo_loss import NOT_MODEL_INPUTS

    chosen, rejected = loss.sequence_logps(model(**{k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS})).chunk(2)
    return {"ref_chosen_logps": chosen, "ref_rejected_logps": rejected}


def last_rewards(trainer) -> dict:
    """The reward metrics of the last logged training step, for train_results.json."""
    logged = [h for h in trainer.state.log_history if "rewards/accuracies" in h and "eval_rewards/accuracies" not in h]
    keys = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
    return {k: logged[-1][k] for k in keys if logged and k in logged[-1]}


METHOD = runner.Method(
    prepare=prepare_data, describe=describe_pairs, build_trainer=build_trainer, trained=lambda data: len(data.train.pairs),
    metrics=last_rewards,
    summary=lambda metrics: f"reward accuracy {metrics.get('rewards/accuracies', float('nan')):.2f}, ",
)
