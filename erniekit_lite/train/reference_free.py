"""Reference-free preference tuning: ORPO (`method: orpo`) and SimPO (`method: simpo`) on packed pair rows.

Both run on the project's Trainer (train/trainer.py) with their loss here; TRL 1.16 keeps them in `trl.experimental`
(`ORPOTrainer`; `CPOTrainer`, whose `loss_type: simpo` is SimPO), and its `odds_ratio_loss`, `cpo_loss` and
`get_batch_loss_metrics` are ported as they are: the same losses, the same metrics under the same names (TRL's
trainers stay the tests' oracle, tests/test_orpo_simpo.py). `train:` still holds TRL's `ORPOConfig` / `CPOConfig`
fields (trainer_args.py), read from the arguments. What differs is the forward and the bookkeeping:

- the model runs once over the packed row (pair_scoring.py: per-sample attention, the LM head at trained positions
  only) in place of TRL's padded chosen + rejected rows with full logits;
- per-sequence log-probs of the response: averaged over its tokens for ORPO (always) and for CPO's ipo / simpo
  losses, summed for its sigmoid / hinge (TRL's `average_log_prob`);
- the NLL of the chosen responses is the per-token term (the Trainer divides it by the step's chosen tokens): ORPO's
  SFT term (coefficient 1), and CPO's `cpo_alpha` term (none when cpo_alpha is 0, as TRL). TRL's CPO takes it over
  the response, as here; TRL's ORPO over prompt + response (trl#1516, the ORPO authors' default;
  `disable_prompt_loss` in their code turns it off). We keep it on the response for both: the loss is on assistant
  turns only, here as in SFT and DPO;
- every other term is per pair (the Trainer divides by the step's pairs): ORPO's −beta · log σ(log odds ratio),
  CPO's losses, and the MoE router aux loss, on as in SFT and DPO when the model config's `router_aux_loss_coef` is
  non-zero (`trainer.ready`; TRL's own rule reads `output_router_logits`, false in ERNIE's released config), as
  coef · aux on each pair of the micro-batch (TRL adds coef · aux to the micro-batch's mean loss), logged as aux_loss;
  both terms are given per pair in row order (the NLL with each pair's chosen tokens), so the evaluation loss leaves
  out the rows accelerate repeats at the end of the evaluation set (`Trainer._pool`);
- metrics are sums and counts kept on the device (train/metrics.py): means over the logging window's pairs (nll_loss
  over its chosen tokens) where TRL logs a mean over each micro-batch; `logits/chosen|rejected` average the mean
  logit of each scored response position (TRL averages the full padded logits, prompt and padding included).

Nothing is read back from the device per micro-batch. There is no reference model and no reference pass. New LoRA
adapters are made as for SFT (model/lora.py), so lora.init and lora.plus_lr_ratio (LoRA+) apply as for SFT.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from erniekit_lite.data.pairs import PackedPairCollator, PaddedPairCollator
from erniekit_lite.model.lora import unwrap
from erniekit_lite.recipe import Recipe
from erniekit_lite.run_plan import RunPlan
from erniekit_lite.train import dpo, scored
from erniekit_lite.train import run as runner
from erniekit_lite.train.common import trainer_inputs
from erniekit_lite.train.trainer import Loss, Parts, RouterAux

NOT_MODEL_INPUTS = ("completion_mask", "chosen_tokens")  # the collator's counts, not the model's


def run(recipe: Recipe, log=print) -> Path:
    return runner.run(recipe, METHOD, log)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, branching at −ln 2 against cancellation (TRL's ORPO)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@dataclass
class Sequences:
    """One pair micro-batch scored: per response, and the chosen responses' NLL."""

    chosen: torch.Tensor  # [B] each chosen response's log-prob, averaged over its tokens or summed
    rejected: torch.Tensor  # [B]
    chosen_nll: torch.Tensor  # [B] each chosen response's Σ −log p over its tokens (differentiable)
    chosen_tokens: torch.Tensor  # [B] each chosen response's scored tokens
    logits: dict  # "chosen" | "rejected" -> (Σ mean logit over the side's scored positions, their count)
    aux_loss: torch.Tensor | None  # the MoE router aux loss, when on


class PairLoss(Loss):
    """What ORPO's and CPO's losses share: a pair is the unit, the chosen response tokens the per-token term's."""

    average: bool  # per-sequence log-probs averaged over the response's tokens (else summed)
    nll_coef: float  # the chosen NLL's coefficient (0: no per-token term)

    def __init__(self, args, aux: RouterAux):
        self.beta, self.aux = args.beta, aux

    def units(self, batch: dict) -> int:
        return batch["input_ids"].shape[0] // 2  # TRL's [2B, L] layout: chosen rows, then rejected

    def chosen_tokens(self, batch: dict) -> int:
        return batch["chosen_tokens"]  # counted by the pair collators on the CPU (data/pairs.py)

    def sequences(self, model, batch: dict) -> Sequences:
        """The packed (or padded) forward, read per sequence (pair_scoring.py's [2B, L-1] layout)."""
        out = model(**{k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}, output_router_logits=self.aux.enabled)
        token, mask = out.log_probs, out.mask
        n = len(token) // 2  # chosen rows first
        logps = token.sum(-1)
        if self.average:
            logps = logps / mask.sum(-1)
        sides = {"chosen": slice(None, n), "rejected": slice(n, None)}
        logits = {side: ((out.mean_logits[rows] * mask[rows]).sum(), mask[rows].sum()) for side, rows in sides.items()}
        return Sequences(logps[:n], logps[n:], -token[:n].sum(-1), mask[:n].sum(-1), logits,
                         out.aux_loss if self.aux.enabled else None)

    def pair_losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> tuple:
        """([B] per-pair losses, chosen rewards, rejected rewards, the method's own metrics as name -> [B] values)."""
        raise NotImplementedError

    def __call__(self, model, batch: dict, trainer, real: int) -> Parts:
        seq = self.sequences(model, batch)
        pairs = seq.chosen.shape[0]
        total, chosen_rewards, rejected_rewards, own = self.pair_losses(seq.chosen, seq.rejected)  # per pair, row order
        mean = lambda values: (values.detach().sum(), pairs)  # noqa: E731  a mean over pairs, as (sum, count)
        metrics = {
            "rewards/chosen": mean(chosen_rewards),
            "rewards/rejected": mean(rejected_rewards),
            "rewards/accuracies": mean((chosen_rewards > rejected_rewards).float()),
            "rewards/margins": mean(chosen_rewards - rejected_rewards),
            "logps/rejected": mean(seq.rejected),
            "logps/chosen": mean(seq.chosen),
            "logits/rejected": seq.logits["rejected"],
            "logits/chosen": seq.logits["chosen"],
            **{name: mean(values) for name, values in own.items()},
        }
        chosen = self.chosen_tokens(batch)
        tokens = None
        if self.nll_coef != 0:  # per pair: its chosen response's NLL summed over its tokens
            tokens = self.nll_coef * seq.chosen_nll
            metrics["nll_loss"] = (seq.chosen_nll.detach().sum(), chosen)
        else:  # TRL logs 0
            metrics["nll_loss"] = (0.0, chosen)
        if seq.aux_loss is not None:  # TRL adds coef · aux to the micro-batch's mean: each pair carries coef · aux
            total = total + self.aux.coef * seq.aux_loss
            metrics["aux_loss"] = (seq.aux_loss, 1)
        return Parts(total=total, tokens=tokens, chosen=seq.chosen_tokens if tokens is not None else None, metrics=metrics)


class ORPOLoss(PairLoss):
    """TRL's `ORPOTrainer.odds_ratio_loss`: −beta · log σ(log odds ratio) per pair, the odds of average log-probs,
    plus the chosen responses' NLL (coefficient 1)."""

    average = True
    nll_coef = 1.0

    def pair_losses(self, chosen, rejected):
        chosen, rejected = chosen.float(), rejected.float()
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        chosen_rewards, rejected_rewards = self.beta * chosen.detach(), self.beta * rejected.detach()
        return -self.beta * ratio, chosen_rewards, rejected_rewards, {"log_odds_ratio": ratio, "log_odds_chosen": log_odds}


class CPOLoss(PairLoss):
    """TRL's `CPOTrainer.cpo_loss`: loss_type sigmoid, hinge, ipo or simpo (SimPO; alphapo is simpo with alpha set,
    TRL's config makes it so), AlphaPO's reward shape when alpha is not 0, label smoothing, plus cpo_alpha × the
    chosen responses' NLL."""

    LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")

    def __init__(self, args, aux: RouterAux):
        super().__init__(args, aux)
        if args.loss_type not in self.LOSS_TYPES:
            raise ValueError(f"Unknown loss type: {args.loss_type}. Should be one of {list(self.LOSS_TYPES)}")
        self.loss_type, self.label_smoothing = args.loss_type, args.label_smoothing
        self.simpo_gamma, self.alpha = args.simpo_gamma, args.alpha
        self.average = self.loss_type in ("ipo", "simpo")
        self.nll_coef = args.cpo_alpha

    def pair_losses(self, chosen, rejected):
        if self.alpha != 0.0:  # AlphaPO: r = (1 − p^(−alpha)) / alpha
            chosen = (1 - torch.exp(chosen).pow(-self.alpha)) / self.alpha
            rejected = (1 - torch.exp(rejected).pow(-self.alpha)) / self.alpha
        logits = chosen - rejected
        if self.loss_type in ("simpo", "sigmoid"):
            if self.loss_type == "simpo":
                logits = logits - self.simpo_gamma / self.beta
            losses = (-F.logsigmoid(self.beta * logits) * (1 - self.label_smoothing)
                      - F.logsigmoid(-self.beta * logits) * self.label_smoothing)
        elif self.loss_type == "hinge":
            losses = torch.relu(1 - self.beta * logits)
        else:  # ipo: eqn (17) of the IPO paper, beta its tau
            losses = (logits - 1 / (2 * self.beta)) ** 2
        return losses, self.beta * chosen.detach(), self.beta * rejected.detach(), {}


def loss_for(method: str, args, aux: RouterAux) -> PairLoss:
    return ORPOLoss(args, aux) if method == "orpo" else CPOLoss(args, aux)


def pair_trainer(method: str, model, args, **inputs):
    """The project's Trainer with ORPO's (`method` orpo) or CPO's loss (simpo: `args.loss_type` says which)."""
    from erniekit_lite.train.trainer import Trainer, ready

    scored.take(unwrap(model))  # pair batches scored in its forward (train/scored.py); a no-op once taken
    return Trainer(model=model, args=args, loss=loss_for(method, args, ready(model, args)), **inputs)


def build_trainer(model, tokenizer, args, data, plan: RunPlan):
    return pair_trainer(plan.method, model, args, **trainer_inputs(data, tokenizer, plan, PackedPairCollator, PaddedPairCollator))


# DPO's pair data, metrics and summary; the adapter made as for SFT (no reference needs the base without it)
METHOD = replace(dpo.METHOD, build_trainer=build_trainer)
