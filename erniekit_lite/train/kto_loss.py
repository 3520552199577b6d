"""KTO's loss, the project's own: TRL 1.16's `KTOTrainer._compute_loss` (its numbers are the tests' oracle) on packed
rows of labelled completions and their KL twins (data/unpaired.py), as per-example losses in row order.

Per example, with r = policy minus reference summed completion log-probs (the reward is beta · r):
- `loss_type: kto` (Eq. 7 of the KTO paper): desirable 1 - σ(beta · (r - kl)), undesirable 1 - σ(beta · (kl - r));
- `apo_zero_unpaired` (APO-zero's unpaired variant): desirable 1 - σ(beta · r), undesirable σ(beta · r), no KL term;
each weighed by `desirable_weight` / `undesirable_weight`. TRL's loss is their mean over the micro-batch; here the
Trainer sums them and divides by the step's examples (train/trainer.py), so every example weighs the same at any
micro-batching, accumulation and process count. The MoE router's aux loss is added per example (each carries
coef · aux of the micro-batch's pass: coef · aux · examples in the sum), as TRL adds coef · aux to its mean.

The KL term (`kl`): the mean over the micro-batch's KL twins of policy minus reference summed log-probs, clamped at 0,
not back-propagated (the twins are scored without gradients). TRL gathers each process's micro-batch mean and
averages them; here the twins are pooled over the processes (one all-reduce of their sum and count, on the device,
no host read): the same number when the processes hold as many examples, and where packed rows give them different
counts, the mean over every twin of the step's micro-batch, as the KTO paper's own trainer (HALOs) pools them. With
one process it is TRL's exactly. Every process calls the loss once per micro-batch (accelerate evens out the last
batch), so the all-reduce lines up.

The policy scores the twins (no grad), then the examples (with grad), then the reference both (reference.py: adapters
off, a frozen adapter copy, a frozen model copy; or precomputed, the rows carrying `ref_logps` / `ref_KL_logps`),
TRL's order; every pass is the scoring forward (pair_scoring.py: the packed row once, the LM head at trained
positions only, values in TRL's padded [B, L-1] layout).

Metrics (TRL's names): kl (per micro-batch; 0 without the KL term), rewards/chosen|rejected and logps/chosen|rejected
over the desirable / undesirable examples, rewards/margins (per micro-batch holding both labels: its mean chosen minus
mean rejected reward, as TRL logs it), logits/chosen|rejected and entropy over completion tokens, aux_loss per
micro-batch. Desirable and undesirable examples are told apart by multiplying with the label as 0/1, never by
indexing: every metric is reported every micro-batch as a device sum and count (train/metrics.py; a count may be 0),
pooled over the logging window and the processes where TRL averages per-micro-batch means. The step reads nothing
back from the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from erniekit_lite.train.step import real_tokens
from erniekit_lite.train.trainer import Loss, Parts

LOSS_TYPES = ("kto", "apo_zero_unpaired")
# batch keys that are not model inputs: the loss's own (labels, precomputed reference values), the collators' counts
NOT_MODEL_INPUTS = ("completion_mask", "label", "ref_logps", "ref_KL_logps", "token_slots", "row_units", "real_tokens")


def side(batch: dict, kl: bool) -> dict:
    """The model inputs of the examples (`kl` False) or of their KL twins (the `KL_` keys, without the prefix)."""
    if kl:
        return {k[3:]: v for k, v in batch.items() if k.startswith("KL_") and k[3:] not in NOT_MODEL_INPUTS}
    return {k: v for k, v in batch.items() if not k.startswith("KL_") and k not in NOT_MODEL_INPUTS}


class KTOLoss(Loss):
    def __init__(self, args, aux, reference):
        if args.loss_type not in LOSS_TYPES:  # recipe.py checks the choices first
            raise ValueError(f"unknown KTO loss type {args.loss_type!r}")
        self.beta = args.beta
        self.loss_type = args.loss_type
        self.desirable_weight = args.desirable_weight
        self.undesirable_weight = args.undesirable_weight
        self.kl = args.loss_type != "apo_zero_unpaired"  # TRL's `calculate_KL`: the rows hold KL twins
        self.aux = aux  # trainer.RouterAux
        self.reference = reference  # reference.Reference

    def units(self, batch: dict) -> int:
        return len(batch["label"])  # one per example: its shape, no read

    def real_tokens(self, batch: dict) -> int:
        real = real_tokens(batch)
        if "KL_input_ids" in batch:
            twins = real_tokens(batch, "KL_")
            real += twins if self.kl else 0  # the twins run through the model too
        return real

    @staticmethod
    def sequence_logps(model, inputs: dict, **kwargs) -> torch.Tensor:
        return model(**inputs, **kwargs).log_probs.sum(1)

    def reference_logps(self, policy, accelerator, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reference's summed completion log-probs of the examples and of their twins (None without the KL
        term): from the rows (precomputed) or its own pass."""
        if self.reference.precomputed:
            return batch["ref_logps"], batch["ref_KL_logps"] if self.kl else None
        return self.reference(policy, accelerator, batch, self.reference_scores)

    def reference_scores(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(examples', twins') summed log-probs under `model`; the twins' first, as TRL."""
        twins = self.sequence_logps(model, side(batch, kl=True)) if self.kl else None
        return self.sequence_logps(model, side(batch, kl=False)), twins

    def __call__(self, model, batch: dict, trainer, real: int) -> Parts:
        accelerator = trainer.accelerator
        twins = None
        if self.kl:
            with torch.no_grad():  # TRL's `_compute_kl_logps`: the twins without gradients
                twins = self.sequence_logps(model, side(batch, kl=True))
        scores = model(**side(batch, kl=False), output_router_logits=self.aux.enabled)
        logps = scores.log_probs.sum(1)
        ref, ref_twins = self.reference_logps(model, accelerator, batch)
        ref = ref.to(logps.dtype)

        kl = self.kl_estimate(twins, ref_twins, accelerator) if self.kl else logps.new_zeros(())
        desirable = batch["label"].to(torch.bool)
        ratio = logps - ref
        if self.loss_type == "kto":
            chosen_losses = 1 - F.sigmoid(self.beta * (ratio - kl))
            rejected_losses = 1 - F.sigmoid(self.beta * (kl - ratio))
        else:  # apo_zero_unpaired
            chosen_losses = 1 - F.sigmoid(self.beta * ratio)
            rejected_losses = F.sigmoid(self.beta * ratio)
        # per example, in row order: its own label's branch, chosen on the device (the other gets no gradient)
        total = torch.where(desirable, self.desirable_weight * chosen_losses, self.undesirable_weight * rejected_losses)
        metrics = self.metrics(scores, desirable.to(logps.dtype), logps.detach(), self.beta * ratio.detach(), kl)
        if scores.aux_loss is not None and self.aux.enabled:
            total = total + self.aux.coef * scores.aux_loss  # each example carries the micro-batch's value
            metrics["aux_loss"] = (scores.aux_loss, 1)
        return Parts(total=total, metrics=metrics)

    @staticmethod
    def kl_estimate(twins: torch.Tensor, ref_twins: torch.Tensor, accelerator) -> torch.Tensor:
        """The clamped mean of policy minus reference over the twins, pooled over the processes (module doc)."""
        difference = (twins - ref_twins.to(twins.dtype)).detach()
        if accelerator.num_processes == 1:
            return difference.mean().clamp(min=0)
        pooled = accelerator.reduce(torch.stack([difference.sum(), difference.new_tensor(float(len(difference)))]), "sum")
        return (pooled[0] / pooled[1]).clamp(min=0)

    @staticmethod
    def metrics(scores, desirable: torch.Tensor, logps: torch.Tensor, rewards: torch.Tensor, kl: torch.Tensor) -> dict:
        """TRL's metrics as (sum, count), split by the label as 0/1 weights: no host read, every one every time."""
        undesirable = 1 - desirable
        chosen, rejected = desirable.sum(), undesirable.sum()
        mask = scores.mask.to(logps.dtype)
        chosen_mask, rejected_mask = mask * desirable[:, None], mask * undesirable[:, None]
        logits = scores.mean_logits.detach()
        chosen_rewards, rejected_rewards = (rewards * desirable).sum(), (rewards * undesirable).sum()
        both = (chosen > 0) & (rejected > 0)  # TRL logs a margin only for a micro-batch holding both labels
        margin = chosen_rewards / chosen.clamp(min=1) - rejected_rewards / rejected.clamp(min=1)
        return {
            "kl": (kl.detach(), 1),
            "entropy": ((scores.entropy * mask).sum(), mask.sum()),
            "logits/chosen": ((logits * chosen_mask).sum(), chosen_mask.sum()),
            "logits/rejected": ((logits * rejected_mask).sum(), rejected_mask.sum()),
            "rewards/chosen": (chosen_rewards, chosen),
            "rewards/rejected": (rejected_rewards, rejected),
            "rewards/margins": (margin * both, both),
            "logps/chosen": ((logps * desirable).sum(), chosen),
            "logps/rejected": ((logps * undesirable).sum(), rejected),
        }
