"""KTO (`method: kto`, TRL 1.16's loss ported in kto_loss.py) on unpaired feedback: what it adds to the shared run
(run.py).

The data are labelled completions, each packed with its KL twin (data/unpaired.py); `train.loss_type:
apo_zero_unpaired` has no KL term, so its rows hold the examples alone. The rows are shuffled and any batch size
works: the twins are fixed inside each row, where TRL pairs them within blocks of its batch in dataset order. The
reference is DPO's (reference.py): a new adapter's is the base with the adapter disabled (no copy); a LoRA run dir
given as model.path keeps its adapter, and a frozen copy of it is the reference; full fine-tuning keeps a frozen
copy of the model, or precomputes (`train.precompute_ref_log_probs`: `ref_logps` per example, `ref_KL_logps` per
twin). PiSSA and OLoRA change the base itself: refused as for DPO. `train:` holds TRL's `KTOConfig` fields
(trainer_args.py), read from the arguments.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

from erniekit_lite.data.prepare import PreparedFeedback, describe_feedback, prepare_feedback
from erniekit_lite.data.unpaired import PackedFeedbackCollator, PaddedFeedbackCollator
from erniekit_lite.recipe import Recipe
from erniekit_lite.run_plan import RunPlan
from erniekit_lite.train import run as runner
from erniekit_lite.train.common import trainer_inputs


def run(recipe: Recipe, log=print) -> Path:
    return runner.run(recipe, method(recipe), log)


def method(recipe: Recipe) -> runner.Method:
    return replace(METHOD, prepare=partial(prepare_feedback, kl=with_kl(recipe)))


def with_kl(recipe: Recipe) -> bool:
    """Whether the loss has KTO's KL term (TRL: every loss_type but apo_zero_unpaired), so rows hold KL twins."""
    return recipe.train.get("loss_type", "kto") != "apo_zero_unpaired"


def rows_dataset(rows):
    """Feedback rows as the `datasets.Dataset` the Trainer iterates."""
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": [r.input_ids for r in rows], "labels": [r.labels for r in rows],
                              "seq_lengths": [r.seq_lengths for r in rows], "desirable": [r.desirable for r in rows]})


def build_trainer(model, tokenizer, args, data: PreparedFeedback, plan: RunPlan):
    from erniekit_lite.train.kto_loss import KTOLoss
    from erniekit_lite.train.reference import trainer_with

    inputs = trainer_inputs(data, tokenizer, plan, PackedFeedbackCollator, PaddedFeedbackCollator, rows=rows_dataset)
    return trainer_with(model, args, plan, inputs, lambda aux, reference: KTOLoss(args, aux, reference), _reference_columns,
                        per_row=lambda row: len(row["desirable"]), settings={"method": "kto", "kl": args.loss_type != "apo_zero_unpaired"})


def _reference_columns(loss, model, batch: dict) -> dict:
    """The reference's summed log-probs per example and per KL twin (no twins, no column), in collator order."""
    examples, twins = loss.reference_scores(model, batch)
    return {"ref_logps": examples, "ref_KL_logps": twins}


METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def last_rewards(trainer) -> dict:
    """The KL and reward metrics of the last logged training step that has them, for train_results.json."""
    logged = [h for h in trainer.state.log_history if "kl" in h]
    return {k: logged[-1][k] for k in METRICS if logged and k in logged[-1]}


def summary(metrics: dict) -> str:
    margin = metrics.get("rewards/margins")
    return (f"reward margin {margin:.3f}, " if margin is not None else "") + f"kl {metrics.get('kl', float('nan')):.3f}, "


METHOD = runner.Method(
    prepare=prepare_feedback, describe=describe_feedback, build_trainer=build_trainer,
    trained=lambda data: len(data.train.examples), metrics=last_rewards, summary=summary,
)
