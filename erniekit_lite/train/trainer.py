"""The project's Trainer: every method but GRPO, on `transformers.Trainer`, with the method's loss as a part.

A method (sft.py, pt.py, dpo.py, kto.py, reference_free.py, rm.py) hands the Trainer one `Loss`: how many units a
micro-batch holds (trained tokens, pairs, examples) and, called on a micro-batch, `Parts`: the sum of its per-unit
losses, the sum of a per-token term over the chosen tokens where it has one, a term already scaled for the step, and
its metrics as sums and counts. The Trainer owns the rest of the step, read top to bottom here:

1. `get_batch_samples`: the optimizer step's micro-batches are fetched and their units (and chosen tokens) counted
   on the host from the collators' numbers, summed over the processes on the device (`average_tokens_across_devices`,
   on by default): N and C of the step, never read back;
2. per micro-batch, `compute_loss`: the method's `Parts`, then the loss the backward runs,
   Σ per-unit losses · W / N + Σ per-token term · W / C + the scaled term, with W the processes whose gradients are
   averaged: so the step's gradient is that of (Σ per-unit losses)/N + (Σ per-token term)/C at any micro-batching,
   accumulation and process count (`loss_is_scaled_for_ga`: the Trainer does not divide by the accumulation again);
3. the metrics stay on the device (`metrics.Metrics`) and are read, pooled over the window and the processes, at a
   logging step only; the evaluation loss is the pooled mean over the evaluation set's units, as training's.

What the base adds to every method (the first-step retry, the divergence guard, atomic checkpoints, real-token
counts) is `step.ErnieTrainer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import transformers

from erniekit_lite.train.metrics import Metrics
from erniekit_lite.train.step import ErnieTrainer, real_tokens


@dataclass
class Parts:
    """One micro-batch's loss, as its method computes it (module doc)."""

    total: torch.Tensor  # the per-unit losses, [units] in row order (or their sum)
    tokens: torch.Tensor | None = None  # a per-token term summed over each unit's chosen tokens, coefficient applied
    chosen: torch.Tensor | None = None  # [units]: each unit's chosen tokens (with `tokens` per unit)
    scaled: torch.Tensor | float = 0.0  # a term already scaled for the step (SFT's router losses); training only
    metrics: dict = field(default_factory=dict)  # name -> (sum, count)


class Loss:
    """What a method gives the Trainer; `units` and `chosen_tokens` count on the host (shapes and the collators'
    numbers), never reading the device."""

    def units(self, batch: dict) -> int:
        raise NotImplementedError

    def chosen_tokens(self, batch: dict) -> int:
        return 0  # no per-token term

    def real_tokens(self, batch: dict) -> int:
        """The real tokens the micro-batch runs through the model (its count keys popped)."""
        return real_tokens(batch)

    def count_step(self, batches: list, trainer, device) -> None:
        """Anything else the method counts once per optimizer step (SFT: the router z-loss's real tokens)."""

    def __call__(self, model, batch: dict, trainer, real: int) -> Parts:
        """`real`: the micro-batch's real tokens (`real_tokens`, popped before)."""
        raise NotImplementedError


@dataclass
class StepCounts:
    units: torch.Tensor | float  # N: the step's units, over the processes when they are averaged
    tokens: torch.Tensor | float  # C: the step's chosen tokens, likewise
    processes: int  # W: the processes whose gradients are averaged (1 when counts are per process)
    micro_batches: int  # G


class Trainer(ErnieTrainer, transformers.Trainer):
    loss_is_scaled_for_ga = True  # `compute_loss` scales for the whole step itself (module doc)

    def __init__(self, *args, loss: Loss, **kwargs):
        self.loss = loss
        self.metrics = Metrics()
        self.step_counts: StepCounts | None = None
        self._eval_sums = None
        super().__init__(*args, **kwargs)

    # --- the step ------------------------------------------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        units = sum(self.loss.units(b) for b in batches)
        tokens = sum(self.loss.chosen_tokens(b) for b in batches)
        processes = 1
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            counts = self.accelerator.reduce(torch.tensor([units, tokens], dtype=torch.float64, device=device), "sum")
            units, tokens, processes = counts[0], counts[1], self.accelerator.num_processes
        self.step_counts = StepCounts(units, tokens, processes, len(batches))
        self.loss.count_step(batches, self, device)
        return batches, None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        slots = inputs.pop("token_slots", 0)
        real = self.loss.real_tokens(inputs)
        rows = inputs.pop("row_units", None)  # the collator's units per row (pair and KTO batches)
        units, chosen = self.loss.units(inputs), self.loss.chosen_tokens(inputs)
        parts = self.loss(model, inputs, self, real)
        self.count_tokens(model, real, slots)
        mode = "train" if model.training else "eval"
        self.metrics.add(mode, parts.metrics)
        total, tokens = parts.total.sum(), parts.tokens.sum() if parts.tokens is not None else None
        if model.training and self.step_counts is not None:
            step = self.step_counts
            loss = total * (step.processes / step.units)
            if tokens is not None:  # C > 0: a pair is kept only if its prompt leaves room for a response
                loss = loss + tokens * (step.processes / step.tokens)
            loss = loss + parts.scaled
        else:  # evaluation: this micro-batch's own means; the evaluation loss pools them (`evaluation_loop`)
            loss = total / max(1, units)
            if tokens is not None:
                loss = loss + tokens / max(1, chosen)
            if self._eval_sums is not None:
                self._pool(parts, rows, units, chosen)
        return (loss, parts) if return_outputs else loss

    def _pool(self, parts: Parts, rows: list[int] | None, units: int, chosen: int) -> None:
        """Adds an evaluation micro-batch to the pooled sums. At the end of the evaluation set accelerate evens out
        the processes' last batch with rows from its start; those rows' units are left out where the loss gives its
        per-unit values in row order (pair and KTO batches: `row_units`)."""
        keep = None
        state = self.accelerator.gradient_state
        if rows is not None and state.end_of_dataloader and state.remainder > 0 and parts.total.dim() == 1:
            # process p holds the global rows [p*b, (p+1)*b) of the last batch; the first `remainder` of them are real
            group = self.accelerator.process_index // self.sequence_parallel
            kept_rows = min(max(state.remainder - group * len(rows), 0), len(rows))
            keep = sum(rows[:kept_rows])
        sums = self._eval_sums
        if keep is None:
            sums[0] += parts.total.detach().double().sum()
            sums[1] += parts.tokens.detach().double().sum() if parts.tokens is not None else 0.0
            sums[2] += units
            sums[3] += chosen
            return
        sums[0] += parts.total.detach().double()[:keep].sum()
        if parts.tokens is not None:
            sums[1] += parts.tokens.detach().double()[:keep].sum()
            sums[3] += parts.chosen[:keep].sum()  # a device sum: nothing read back here
        sums[2] += keep

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def evaluation_loop(self, *args, metric_key_prefix: str = "eval", **kwargs):
        """`eval_loss` as the pooled mean over the evaluation set's units (tokens, pairs, examples), as training's
        loss is: the Trainer's mean of per-batch losses over-weights the units of small batches."""
        device = self.accelerator.device
        self._eval_sums = [torch.zeros((), dtype=torch.float64, device=device),
                           torch.zeros((), dtype=torch.float64, device=device), 0, 0]
        try:
            output = super().evaluation_loop(*args, metric_key_prefix=metric_key_prefix, **kwargs)
            total, tokens, units, chosen = self._eval_sums
        finally:
            self._eval_sums = None
        sums = torch.stack([torch.as_tensor(x, dtype=torch.float64, device=device).reshape(()) for x in (total, tokens, units, chosen)])
        if self.accelerator.num_processes > 1:
            sums = self.accelerator.reduce(sums, "sum")
        total, tokens, units, chosen = sums.tolist()
        if units and f"{metric_key_prefix}_loss" in output.metrics:
            output.metrics[f"{metric_key_prefix}_loss"] = total / units + (tokens / chosen if chosen else 0.0)
        return output

    def log(self, logs: dict, start_time: float | None = None) -> None:
        evaluation = any(k.startswith("eval_") for k in logs) and "loss" not in logs
        means = self.metrics.read("eval" if evaluation else "train", self.accelerator)
        logs.update({f"eval_{k}" if evaluation else k: v for k, v in means.items()})
        if "loss" in logs:  # the real tokens trained so far (this process's, the run before a resume's included)
            logs["num_tokens"] = float(self.state.num_input_tokens_seen)
        super().log(logs, start_time)


@dataclass(frozen=True)
class RouterAux:
    """The MoE load-balancing loss as a run adds it: on when the model returns router logits and its coefficient
    (`train.router_aux_loss_coef`, else the config's own) is not 0."""

    enabled: bool
    coef: float


def ready(model, args, moe_aux: bool = True) -> RouterAux:
    """What a model needs before the Trainer takes it (what TRL 1.16's trainers did in their `__init__`, kept for the
    same numbers): input gradients for adapters under activation checkpointing, a QLoRA's trained weights in bf16 (the
    QLoRA paper's recipe; DoRA's magnitudes kept in their dtype), dropout off where the method's arguments say
    (`disable_dropout`: the preference methods' default, so the two passes of a pair agree), and the MoE aux loss
    decided once and written into the config the model's own forward reads (`moe_aux=False`: the method adds none,
    and the config is left as loaded)."""
    peft = hasattr(model, "peft_config")
    if peft and (args.gradient_checkpointing or getattr(args, "activation_checkpointing", False)):
        model.enable_input_require_grads()
    if peft and (getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)):
        for name, param in model.named_parameters():
            if param.requires_grad and "lora_magnitude_vector" not in name:
                param.data = param.data.to(torch.bfloat16)
    if getattr(args, "disable_dropout", False):
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    text = model.config.get_text_config()
    if not moe_aux:
        return RouterAux(False, 0.0)
    chosen = getattr(args, "router_aux_loss_coef", None)
    coef = getattr(text, "router_aux_loss_coef", 0.0) if chosen is None else chosen
    if chosen and not hasattr(text, "output_router_logits"):
        from erniekit_lite.errors import UserError

        raise UserError(f"train.router_aux_loss_coef is {chosen} but {type(model).__name__} is not a mixture-of-experts model: remove it")
    enabled = hasattr(text, "output_router_logits") and coef != 0.0
    if hasattr(text, "router_aux_loss_coef"):
        text.output_router_logits, text.router_aux_loss_coef = enabled, float(coef)
    return RouterAux(enabled, coef or 0.0)
