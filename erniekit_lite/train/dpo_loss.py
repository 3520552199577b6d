"""DPO's loss, the project's own: every loss type of TRL 1.16's `DPOTrainer` (its numbers are the tests' oracle),
on packed pair rows, as a sum over the micro-batch's pairs.

The policy's pass and the reference's (reference.py) run through the scoring forward (pair_scoring.py: the packed
row once, the LM head at trained positions only) and return per-token values in the [2B, L-1] layout, chosen rows
first. Per sequence: the summed completion log-probs (LD-DPO's `ld_alpha` weighs the tokens past the shorter
answer's length); the f-divergence turns the log-ratios into scores; each loss type gives a per-pair loss, summed
with its weight (`loss_weights`), WPO's weights applied when `use_weighting`. The `sft` type is a per-token term
over the chosen tokens (the step's, train/trainer.py). The MoE router's aux loss is added per pair (each pair
carries the micro-batch's value). `aot`/`aot_unpaired` sort within the micro-batch, as TRL's do.

Metrics (TRL's names): rewards/chosen|rejected|accuracies|margins and logps/chosen|rejected over pairs;
logits/chosen|rejected, mean_token_accuracy and entropy over completion tokens; aux_loss per micro-batch. All stay
on the device as sums and counts (train/metrics.py): the step reads nothing back.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from erniekit_lite.train.trainer import Loss, Parts

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
              "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
F_DIVERGENCE = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
NOT_MODEL_INPUTS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps", "chosen_tokens")


class DPOLoss(Loss):
    def __init__(self, args, aux, reference):
        self.beta = args.beta
        self.loss_types = list(args.loss_type) if isinstance(args.loss_type, (list, tuple)) else [args.loss_type]
        self.loss_weights = list(args.loss_weights) if args.loss_weights is not None else [1.0] * len(self.loss_types)
        self.label_smoothing = args.label_smoothing
        self.f_divergence = args.f_divergence_type
        self.f_alpha = args.f_alpha_divergence_coef
        self.ld_alpha = args.ld_alpha
        self.use_weighting = args.use_weighting
        self.discopop_tau = args.discopop_tau
        self.aux = aux  # trainer.RouterAux
        self.reference = reference  # reference.Reference

    def units(self, batch: dict) -> int:
        return batch["input_ids"].shape[0] // 2  # the [2B, L] layout: chosen rows, then rejected

    def chosen_tokens(self, batch: dict) -> int:
        return batch["chosen_tokens"] if "sft" in self.loss_types else 0  # counted by the pair collators on the CPU

    def sequence_logps(self, scores) -> torch.Tensor:
        """[2B] summed completion log-probs; with `ld_alpha`, the tokens past the shorter answer's length weigh
        `ld_alpha` (LD-DPO)."""
        token = scores.log_probs
        if self.ld_alpha is None:
            return token.sum(1)
        mask = scores.mask.to(token.dtype)
        position = mask.cumsum(1)
        lengths = mask.sum(1)
        chosen, rejected = lengths.chunk(2)
        shared = torch.minimum(chosen, rejected).repeat(2)[:, None]
        in_shared = (position > 0) & (position <= shared) & scores.mask
        in_tail = (position > shared) & scores.mask
        return (token * in_shared).sum(1) + self.ld_alpha * (token * in_tail).sum(1)

    def reference_logps(self, policy, accelerator, batch: dict) -> torch.Tensor:
        """[2B] the reference's summed completion log-probs: from the rows (precomputed) or its own pass."""
        if self.reference.precomputed:
            return torch.cat([batch["ref_chosen_logps"], batch["ref_rejected_logps"]])
        inputs = {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}
        return self.reference(policy, accelerator, inputs, lambda model, b: self.sequence_logps(model(**b)))

    def __call__(self, model, batch: dict, trainer, real: int) -> Parts:
        inputs = {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}
        scores = model(**inputs, output_router_logits=self.aux.enabled)
        logps = self.sequence_logps(scores)
        ref = self.reference_logps(model, trainer.accelerator, batch).to(logps.dtype)
        pairs = len(logps) // 2
        chosen_logps, rejected_logps = logps.chunk(2)
        ref_chosen, ref_rejected = ref.chunk(2)
        chosen_ratio, rejected_ratio = chosen_logps - ref_chosen, rejected_logps - ref_rejected
        chosen_score, rejected_score = self.f_scores(chosen_ratio), self.f_scores(rejected_ratio)
        lengths = scores.mask.sum(1).clamp(min=1).to(logps.dtype)
        weights = self.wpo_weights(scores, lengths) if self.use_weighting else None

        total = logps.new_zeros(pairs)  # per pair, in row order
        tokens = None
        for loss_type, weight in zip(self.loss_types, self.loss_weights, strict=True):
            if loss_type == "sft":  # a per-token term: the chosen tokens' NLL, over the step's chosen tokens
                nll = -(scores.log_probs[:pairs] * scores.mask[:pairs]).sum(1)
                # TRL expands its (micro-batch) mean over the pairs before WPO's weights: the same here, per token
                term = weight * nll * (weights.mean() if weights is not None else 1.0)
                tokens = term if tokens is None else tokens + term
                continue
            per_pair = self.per_pair(loss_type, chosen_ratio, rejected_ratio, chosen_score, rejected_score,
                                     chosen_logps - rejected_logps, ref_chosen - ref_rejected, lengths)
            if weights is not None:
                per_pair = per_pair * weights
            total = total + weight * per_pair
        metrics = self.metrics(scores, chosen_ratio, rejected_ratio, chosen_logps, rejected_logps, pairs)
        if scores.aux_loss is not None and self.aux.enabled:
            total = total + self.aux.coef * scores.aux_loss  # each pair carries the micro-batch's value
            metrics["aux_loss"] = (scores.aux_loss, 1)
        return Parts(total=total, tokens=tokens, chosen=scores.mask[:pairs].sum(1) if tokens is not None else None,
                     metrics=metrics)

    def f_scores(self, ratio: torch.Tensor) -> torch.Tensor:
        """f'(policy/reference) of the f-divergence (f-DPO), from the log-ratio."""
        if self.f_divergence == "reverse_kl":
            return ratio
        if self.f_divergence == "forward_kl":
            return 1 - torch.exp(-ratio)
        if self.f_divergence == "js_divergence":
            return math.log(2) + F.logsigmoid(ratio)
        if abs(self.f_alpha - 1.0) < 1e-6:  # alpha_divergence's limit at 1: reverse KL
            return ratio
        t = (self.f_alpha - 1.0) * ratio
        # clamped so exp(.) stays representable in the dtype it goes back to
        top = {torch.float16: 11.0, torch.bfloat16: 80.0, torch.float32: 80.0}.get(t.dtype, 80.0)
        return (torch.exp(torch.clamp(t.float(), max=top)) - 1.0).to(t.dtype) / (self.f_alpha - 1.0)

    def wpo_weights(self, scores, lengths: torch.Tensor) -> torch.Tensor:
        """[B] WPO's pair weights: the product of each side's length-normalised sequence probability (no grad)."""
        with torch.no_grad():
            aligned = ((scores.log_probs - scores.log_sum_sq_probs) * scores.mask).sum(1) / lengths
            chosen, rejected = torch.exp(aligned).chunk(2)
        return chosen * rejected

    def per_pair(self, loss_type, chosen_ratio, rejected_ratio, chosen_score, rejected_score, logratios, ref_logratios,
                 lengths) -> torch.Tensor:
        beta, smoothing = self.beta, self.label_smoothing
        delta = chosen_score - rejected_score
        if loss_type == "sigmoid":
            return -F.logsigmoid(beta * delta)
        if loss_type == "hinge":
            return torch.relu(1 - beta * delta)
        if loss_type in ("ipo", "sigmoid_norm"):  # per completion token: comparable across lengths
            chosen_length, rejected_length = lengths.chunk(2)
            normed = chosen_score / chosen_length - rejected_score / rejected_length
            return (normed - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * normed)
        if loss_type == "exo_pair":
            epsilon = torch.tensor(smoothing, device=delta.device)
            return (torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - torch.log1p(-epsilon))
                    + torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - torch.log(epsilon)))
        if loss_type == "nca_pair":
            chosen, rejected = beta * chosen_ratio, beta * rejected_ratio
            return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)
        if loss_type == "robust":
            return (-(1 - smoothing) * F.logsigmoid(beta * delta) + smoothing * F.logsigmoid(-beta * delta)) / (1 - 2 * smoothing)
        if loss_type == "bco_pair":
            return -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
        if loss_type == "sppo_hard":
            return (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
        if loss_type in ("aot", "aot_unpaired"):  # sorted within the micro-batch, as TRL's
            if loss_type == "aot":
                d = torch.sort(logratios, dim=0)[0] - torch.sort(ref_logratios, dim=0)[0]
            else:
                d = torch.sort(chosen_ratio, dim=0)[0] - torch.sort(rejected_ratio, dim=0)[0]
            return -F.logsigmoid(beta * d) * (1 - smoothing) - F.logsigmoid(-beta * d) * smoothing
        if loss_type == "apo_zero":
            return 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
        if loss_type == "apo_down":
            return torch.sigmoid(beta * chosen_ratio) + 1 - torch.sigmoid(beta * (chosen_ratio - rejected_ratio))
        if loss_type == "discopop":
            logits = beta * delta
            modulation = torch.sigmoid(logits / self.discopop_tau)
            return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
        raise ValueError(f"unknown DPO loss type {loss_type!r}")  # recipe.py checks the choices first

    def metrics(self, scores, chosen_ratio, rejected_ratio, chosen_logps, rejected_logps, pairs: int) -> dict:
        mask = scores.mask
        chosen_mask, rejected_mask = mask[:pairs], mask[pairs:]
        chosen_rewards, rejected_rewards = self.beta * chosen_ratio.detach(), self.beta * rejected_ratio.detach()
        logits = scores.mean_logits.detach()
        return {
            "entropy": ((scores.entropy * mask).sum(), mask.sum()),
            "logits/chosen": ((logits[:pairs] * chosen_mask).sum(), chosen_mask.sum()),
            "logits/rejected": ((logits[pairs:] * rejected_mask).sum(), rejected_mask.sum()),
            "mean_token_accuracy": ((scores.is_top1[:pairs] & chosen_mask).sum(), chosen_mask.sum()),
            "rewards/chosen": (chosen_rewards.sum(), pairs),
            "rewards/rejected": (rejected_rewards.sum(), pairs),
            "rewards/accuracies": ((chosen_rewards > rejected_rewards).sum(), pairs),
            "rewards/margins": ((chosen_rewards - rejected_rewards).sum(), pairs),
            "logps/chosen": (chosen_logps.detach().sum(), pairs),
            "logps/rejected": (rejected_logps.detach().sum(), pairs),
        }
