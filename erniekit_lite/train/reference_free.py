"""Reference-free preference tuning: ORPO (`method: orpo`) and SimPO (`method: simpo`) on packed pair rows.

TRL 1.16 keeps both in `trl.experimental`: `ORPOTrainer`, and `CPOTrainer` whose `loss_type: simpo` is SimPO. We
keep their losses and metrics (`get_batch_loss_metrics`, `odds_ratio_loss`, `cpo_loss`) and replace only
`concatenated_forward`, which TRL runs over padded chosen + rejected rows with full logits. Ours runs the model once
over the packed row (pair_scoring.py: per-sample attention, the LM head at trained positions only) and returns what
TRL's loss reads from it:

- per-sequence log-probs of the response: averaged over its tokens for ORPO (always) and for CPO's ipo / simpo
  losses, summed for its sigmoid / hinge (TRL's `average_log_prob`);
- the NLL of the chosen responses, the mean over all their tokens in the batch: ORPO's SFT term, and CPO's
  `cpo_alpha` term (0 when cpo_alpha is 0, as TRL). TRL's CPO takes it over the response, as here; TRL's ORPO over
  prompt + response (trl#1516, the ORPO authors' default; `disable_prompt_loss` in their code turns it off). We
  keep it on the response for both: the loss is on assistant turns only, here as in SFT and DPO;
- per-position mean logits of the responses, for TRL's `logits/chosen|rejected` metrics (TRL averages the full
  padded logits, prompt and padding included);
- the MoE router aux loss, on as in SFT and DPO when the model config's `router_aux_loss_coef` is non-zero (these
  configs have no such field; TRL's own rule reads `output_router_logits`, false in ERNIE's released config).

There is no reference model and no reference pass. New LoRA adapters are made as for SFT (model/lora.py), not by
TRL, so lora.init and lora.plus_lr_ratio (LoRA+) apply as for SFT. TRL's `__init__` tokenizes raw prompt / chosen /
rejected text with three `Dataset.map`s; our rows are tokenized and packed already (data/pairs.py), so it is handed
a view whose `map` returns it unchanged.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import torch

from erniekit_lite.data.pairs import PackedPairCollator, PaddedPairCollator
from erniekit_lite.model.lora import unwrap
from erniekit_lite.recipe import Recipe
from erniekit_lite.run_plan import RunPlan
from erniekit_lite.train import dpo
from erniekit_lite.train import run as runner
from erniekit_lite.train.common import trainer_inputs
from erniekit_lite.train import scored
from erniekit_lite.train.step_weights import PairTrainer

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # trl.experimental warns once, at import, that its APIs may change
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

NOT_MODEL_INPUTS = ("completion_mask", "token_slots")  # for TRL's loss bookkeeping and our token count


def run(recipe: Recipe, log=print) -> Path:
    return runner.run(recipe, METHOD, log)


class _Tokenized:
    """A dataset whose `map` returns it unchanged: what TRL's `__init__` gets instead of our rows (see the module doc)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def map(self, *args, **kwargs):
        return self

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i]

    def __getattr__(self, name):
        return getattr(self.dataset, name)


def wrapped(kwargs: dict) -> dict:
    """TRL's keywords with our rows as datasets whose `map` returns them unchanged (TRL's `__init__` tokenizes)."""
    return {**kwargs, "train_dataset": _Tokenized(kwargs["train_dataset"]),
            "eval_dataset": None if kwargs.get("eval_dataset") is None else _Tokenized(kwargs["eval_dataset"])}


def set_up(trainer, kwargs: dict) -> None:
    """After TRL's `__init__`: our rows back, the MoE aux loss as in SFT and DPO, the packed forward."""
    trainer.train_dataset, trainer.eval_dataset = kwargs["train_dataset"], kwargs.get("eval_dataset")
    trainer.use_dpo_data_collator = True  # else `prediction_step` warns at every eval batch; ours carries all it needs
    config = trainer.model.config.get_text_config()
    trainer.router_aux_loss_coef = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
    trainer.aux_loss_enabled = hasattr(config, "output_router_logits") and trainer.router_aux_loss_coef != 0.0
    trainer.aux_loss_coef = trainer.router_aux_loss_coef  # what TRL's `get_batch_loss_metrics` adds the aux loss with
    scored.take(unwrap(trainer.model))  # pair batches scored in its forward (train/scored.py; TRL put no head on)


def concatenated_forward(self, model, batch):
    """TRL's (chosen_logps, rejected_logps, chosen_logits, rejected_logits, nll_loss[, aux_loss]) from one packed
    forward, in place of TRL's ORPO / CPO `concatenated_forward`. The logits are each side's mean logit over its scored
    positions (TRL's metrics take their `.mean()`). `self.average_log_prob`, `self.with_nll` and `self.nll_coef` say
    what the trainer's loss reads."""
    out = model(**{k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}, output_router_logits=self.aux_loss_enabled)
    token, mask = out.log_probs, out.label_mask
    n = len(token) // 2  # chosen rows first
    logps = token.sum(-1)
    if self.average_log_prob:
        logps = logps / mask.sum(-1)
    if self.with_nll:
        nll = -token[:n].sum() / mask[:n].sum()
        self._token_term = (self.nll_coef, nll)  # weighed by the step's chosen tokens (step_weights.py)
    else:
        nll = token.new_zeros(())
    # TRL logs each side's `.mean()`: the mean over its scored positions, as one value (a boolean mask's size would
    # be a host read)
    def mean_logit(rows: slice) -> torch.Tensor:
        return ((out.mean_logits[rows] * mask[rows]).sum() / mask[rows].sum()).reshape(1)

    result = (logps[:n], logps[n:], mean_logit(slice(None, n)), mean_logit(slice(n, None)), nll)
    if not self.aux_loss_enabled:
        return result
    # TRL's loss adds it; logged as in SFT and DPO (TRL's ORPO and CPO do not log it)
    # kept on the device until a logging step (trl_metrics.read_back)
    self.store_metrics({"aux_loss" if model.training else "eval_aux_loss": out.aux_loss.detach()}, "train" if model.training else "eval")
    return result + (out.aux_loss,)


class ErnieORPOTrainer(PairTrainer, ORPOTrainer):
    average_log_prob = True  # the odds ratio of average log-probs
    with_nll = True
    nll_coef = 1.0
    concatenated_forward = concatenated_forward

    def __init__(self, **kwargs):
        super().__init__(**wrapped(kwargs))
        set_up(self, kwargs)


class ErnieCPOTrainer(PairTrainer, CPOTrainer):
    """`method: simpo` (loss_type simpo, trainer_args.py); the other CPO losses work alike."""

    concatenated_forward = concatenated_forward

    def __init__(self, **kwargs):
        super().__init__(**wrapped(kwargs))
        set_up(self, kwargs)

    @property
    def average_log_prob(self) -> bool:
        return self.loss_type in ("ipo", "simpo")

    @property
    def with_nll(self) -> bool:
        return self.cpo_alpha != 0

    @property
    def nll_coef(self) -> float:
        return self.cpo_alpha


def build_trainer(model, tokenizer, args, data, plan: RunPlan):
    trainer = ErnieORPOTrainer if plan.method == "orpo" else ErnieCPOTrainer
    return trainer(model=model, args=args, **trainer_inputs(data, tokenizer, plan, PackedPairCollator, PaddedPairCollator))


# DPO's pair data, metrics and summary; the adapter made as for SFT (no reference needs the base without it)
METHOD = replace(dpo.METHOD, build_trainer=build_trainer, adapter_by_trainer=False)
