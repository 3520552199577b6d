"""TRL's SFTTrainer over rows we tokenized and packed ourselves.

Two departures from `SFTTrainer.compute_loss`, both because ERNIE's 103k-entry LM head dominates small models:
- the LM head runs only at positions whose next token is trained, in memory-bounded chunks (`scoring.py`), so
  prompt tokens never pay for it; token accuracy comes from the same pass;
- real-token accounting (tokens/s without padding, packing efficiency) per logged step and in `train_results.json`.
Checkpoints are atomic and a diverged run stops before its bad step (`checkpoints.CheckpointMixin`); LoRA+ builds
the optimizer through peft (`optimizer.OptimizerMixin`); a PiSSA/OLoRA adapter is saved as a plain LoRA at the end
(`PlainLoraSaveMixin`); a first step out of memory turns activation checkpointing on when the plan had turned it off
(`OutOfMemoryRetryMixin`); everything else (optimizer, schedule, logging, accumulation) is TRL and transformers.
"""

from __future__ import annotations

import copy
import gc
import time

import torch
from trl import SFTTrainer

from erniekit_lite.errors import UserError
from erniekit_lite.model.attention import take_batch_lengths
from erniekit_lite.model.lora import INITIAL, save_as_plain_lora, unwrap
from erniekit_lite.plan import CHECKPOINTING_OFF_BY_PLAN
from erniekit_lite.train.checkpoints import CheckpointMixin
from erniekit_lite.train.optimizer import OptimizerMixin
from erniekit_lite.train.scoring import add_scoring_forward
from erniekit_lite.train.router_losses import RouterLossMixin


# What a micro-batch's training step adds to, put back before the first step's batches run again: the real-token
# counts, TRL's logged metrics, GRPO's micro-step counter (it picks the buffered generation) and step time
_STEP_STATE = ("real_tokens", "token_slots", "_since_log", "_metrics", "_step", "_current_train_step_time")
RETRIED_AT = "activation_checkpointing_turned_on_at_step"  # train_results.json: the first step ran out of memory


class OutOfMemoryRetryMixin:
    """A first optimizer step that runs out of memory with activation checkpointing off, where the memory plan
    turned it off (`plan.choose_checkpointing`, one process): checkpointing goes on as transformers turns it on, a
    trained LM head recomputes its chunks (the plan that kept them is the one that proved low), the step's
    gradients so far are zeroed and its micro-batches run again from the first, counters as before the step. Any
    other first-step out-of-memory ends the run with one line naming the settings that lower memory.

    Caught in `training_step`, which every method's Trainer runs once per micro-batch from the Trainer's own loop,
    so the loop, its loss sum and the optimizer step are left as they are. Out of memory later in the first step
    (clipping, or the first `optimizer.step` allocating AdamW's state) ends the run with the same line: `train`
    sees it leave the loop before any step finished."""

    retried_at: int | None = None  # the step that ran out of memory and ran again
    _first: tuple[int, dict, list] | None = None  # first step: (global step before it, state before it, its batches)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._first is None:
            self._first = (self.state.global_step, self._step_state(), [])
        step, before, batches = self._first
        if self.state.global_step != step:
            batches.clear()  # past the first step: the Trainer's batches are not held here any longer
            return super().training_step(model, inputs, num_items_in_batch)
        batches.append((inputs, num_items_in_batch))
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        except torch.OutOfMemoryError:
            if not self._may_retry():
                raise UserError(self._lower_memory(step + 1)) from None
        # Out of the handler: its traceback held the failed pass's tensors
        self._checkpointing_on(step + 1)
        self._first = (step, before, [])
        self._restore(before)
        model.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        for inputs, num_items_in_batch in batches:  # this method again: out of memory now is the one-line error
            loss = self.training_step(model, inputs, num_items_in_batch)
        return loss  # the earlier batches' losses are already in the Trainer's sum

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        except torch.OutOfMemoryError:
            if self._first is None or self.state.global_step != self._first[0]:
                raise  # before the first micro-batch, or after the first step: not the first step's memory
            failed = self._first[0] + 1
        raise UserError(self._lower_memory(failed)) from None

    def retry_metrics(self) -> dict:
        """For train_results.json: the step that ran out of memory and ran again with checkpointing on, if any."""
        return {RETRIED_AT: self.retried_at} if self.retried_at is not None else {}

    def _may_retry(self) -> bool:
        return (getattr(self.args, CHECKPOINTING_OFF_BY_PLAN, False) and not self.args.activation_checkpointing
                and not self.is_deepspeed_enabled)  # DeepSpeed accumulates gradients in its own buffers

    def _checkpointing_on(self, step: int) -> None:
        """Activation checkpointing as `Trainer.train` turns it on (and TRL, for an adapter), and the LM head's chunks
        recomputed (`common.plan_lm_head`); said in one line."""
        kwargs = dict(self.args.activation_checkpointing_kwargs or {})
        every, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
        self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None, every_n_layers=every,
                                                   offload=offload)
        if hasattr(self.model, "peft_config"):
            self.model.enable_input_require_grads()
        self.args.activation_checkpointing = self.args.gradient_checkpointing = True
        base = unwrap(self.model)
        head = ", the LM head's chunks recomputed" if getattr(base, "_erniekit_head_keep_positions", 0) else ""
        base._erniekit_head_keep_positions = 0
        self.retried_at = step
        print(f"out of memory at step {step} with activation checkpointing off (the memory plan said the run fits): "
              f"turned it on{head}; running the step's batches again")

    def _lower_memory(self, step: int) -> str:
        args, model = self.args, self.model
        settings = ["data.max_length", f"train.per_device_train_batch_size (now {args.per_device_train_batch_size}; "
                    "train.gradient_accumulation_steps keeps the batch)"]
        if not args.activation_checkpointing:
            settings.append("train.activation_checkpointing: true")
        elif not (args.activation_checkpointing_kwargs or {}).get("offload"):
            settings.append("train.activation_checkpointing_kwargs: {offload: true}")
        if not hasattr(model, "peft_config"):
            settings.append("a lora: section (adapters instead of every weight)")
        elif not getattr(getattr(model, "config", None), "quantization_config", None):
            settings.append("model.load_in_4bit: true")
        settings.append("or more GPUs sharding the model (--num-processes N --accelerate-config recipes/accelerate/fsdp2.yaml)")
        state = "on" if args.activation_checkpointing else "off"
        return f"out of memory at step {step} (activation checkpointing {state}); these settings lower memory: {', '.join(settings)}"

    def _step_state(self) -> dict:
        state = {k: copy.deepcopy(self.__dict__[k]) for k in _STEP_STATE if k in self.__dict__}
        return {**state, "num_input_tokens_seen": self.state.num_input_tokens_seen}

    def _restore(self, saved: dict) -> None:
        for k in _STEP_STATE:
            if k in saved:
                setattr(self, k, copy.deepcopy(saved[k]))
            else:
                self.__dict__.pop(k, None)  # back to the class default
        self.state.num_input_tokens_seen = saved["num_input_tokens_seen"]


class ThroughputMixin(OutOfMemoryRetryMixin):  # every method's Trainer has it: the first-step retry comes with it
    """Real-token accounting for any Trainer: totals for train_results.json, rates in each logged step."""

    real_tokens = 0  # non-pad tokens forwarded in training
    token_slots = 0  # tokens the batches could hold (rows x row capacity when packed; padded size otherwise)
    _since_log = None  # (time, real_tokens, token_slots) at the previous log

    def count_tokens(self, model, real: int, slots: int) -> None:
        if model.training:
            if self._since_log is None:  # the first training forward starts the clock
                self._since_log = (time.perf_counter(), self.real_tokens, self.token_slots)
            self.real_tokens += real
            self.token_slots += int(slots)
            # Kept in the TrainerState, so checkpoints carry it and a resumed run counts on from there (the
            # Trainer itself updates it only with include_num_input_tokens_seen, which counts pads too)
            self.state.num_input_tokens_seen += real

    def log(self, logs: dict, start_time: float | None = None) -> None:
        # Metrics kept as device tensors between logging steps (a `.item()` per micro-batch stalled the GPU each
        # time) are read back here, in one transfer per kind
        kept = [*getattr(self, "_metrics", {}).values(), *getattr(self, "_stored_metrics", {}).values()]  # ORPO, CPO: stored
        held = [(values, i) for metrics in kept for values in metrics.values() for i, v in enumerate(values) if torch.is_tensor(v)]
        # Counts (TRL's token counter) as integers: through float32 they are exact only below 2^24
        parts = {kind: [(values, i) for values, i in held if values[i].is_floating_point() == (kind is torch.float32)]
                 for kind in (torch.float32, torch.int64)}
        for kind, these in parts.items():
            if these:
                read = torch.stack([values[i].detach().to(kind).reshape(()) for values, i in these]).tolist()
                for (values, i), value in zip(these, read):
                    values[i] = value
        if "loss" in logs:  # every process logs the same steps, so the sum below is collective-safe
            now = time.perf_counter()
            then, tokens, slots = self._since_log or (now, 0, 0)
            real, capacity = self._all_processes(self.real_tokens - tokens, self.token_slots - slots)
            if real and now > then:
                logs["tokens_per_second"] = round(real / (now - then), 1)
            if capacity:
                logs["packing_efficiency"] = round(real / capacity, 4)
            self._since_log = (now, self.real_tokens, self.token_slots)
        super().log(logs, start_time)

    def throughput(self, runtime: float) -> dict:
        real, slots = self._all_processes(self.real_tokens, self.token_slots)
        return {
            "train_tokens": real,
            "train_tokens_per_second": round(real / runtime, 2) if runtime else 0.0,
            "packing_efficiency": round(real / slots, 4) if slots else 0.0,
        }

    def _all_processes(self, real: int, slots: int) -> tuple[int, int]:
        """Token counts summed over the processes of a launched run (each counts its own batches)."""
        if self.accelerator.num_processes == 1:
            return real, slots
        total = self.accelerator.reduce(torch.tensor([real, slots], device=self.accelerator.device), reduction="sum")
        return int(total[0]), int(total[1])


def real_tokens(inputs: dict, side: str = "") -> int:
    """The non-pad tokens of a batch (popped): as the collator counted them (`collate.host_facts`), else counted here,
    a read from the device, for a batch some other collator made."""
    real = inputs.pop(f"{side}real_tokens", None)
    if real is None:
        mask = inputs.get(f"{side}attention_mask")
        real = int(mask.sum()) if mask is not None else inputs[f"{side}input_ids"].numel()
    return real


class HostBoundsMixin:
    """The sample lengths the collator counted on the CPU (`collate.host_facts`) are handed to per-sample attention
    once the batch is on the GPU (accelerate's dataloader moves it before `_prepare_inputs`), so no step reads them
    back from the device (a host sync each)."""

    def _prepare_inputs(self, inputs):
        return take_batch_lengths(super()._prepare_inputs(inputs))


class PlainLoraSaveMixin:
    """PiSSA/OLoRA changed the base weights in memory; the run's final adapter is rewritten as a plain LoRA on the
    unchanged base (`lora.save_as_plain_lora`), so loading, merging, serving and export see an ordinary adapter.
    Checkpoints (`_internal_call`) keep peft's own form, which resuming loads into the changed base it was made for."""

    def save_model(self, output_dir=None, _internal_call: bool = False):
        super().save_model(output_dir, _internal_call)
        initial = getattr(self.model, INITIAL, None)
        if initial is not None and not _internal_call and self.args.should_save:
            save_as_plain_lora(output_dir if output_dir is not None else self.args.output_dir, initial)


class ErnieSFTTrainer(CheckpointMixin, ThroughputMixin, HostBoundsMixin, OptimizerMixin, PlainLoraSaveMixin, RouterLossMixin, SFTTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        add_scoring_forward(unwrap(self.model))

    def evaluation_loop(self, *args, metric_key_prefix: str = "eval", **kwargs):
        """`eval_loss` as the token-weighted mean over the whole eval set, as training's loss is.

        The Trainer averages per-batch losses (weighted by rows), which over-weights tokens of short batches;
        `erniekit-lite eval` and this agree exactly.
        """
        self._eval_nll, self._eval_tokens = torch.zeros((), dtype=torch.float64, device=self.accelerator.device), 0
        output = super().evaluation_loop(*args, metric_key_prefix=metric_key_prefix, **kwargs)
        nll, tokens = self._eval_nll, torch.tensor(self._eval_tokens, device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            nll, tokens = self.accelerator.reduce(nll, "sum"), self.accelerator.reduce(tokens, "sum")
        if int(tokens) and f"{metric_key_prefix}_loss" in output.metrics:
            output.metrics[f"{metric_key_prefix}_loss"] = float(nll / tokens)
        return output

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        slots = inputs.pop("token_slots", labels.numel())
        real = real_tokens(inputs)
        scores = model(**inputs, score_labels=labels, output_router_logits=self.aux_loss_enabled,
                       score_router_logits=bool(self.router_z_coef))
        n = scores.log_probs.numel()
        loss = -scores.log_probs.sum() / (num_items_in_batch if num_items_in_batch is not None else max(1, n))
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes
        steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else None
        if scores.aux_loss is not None:
            loss = loss + self.router_aux_loss_coef * scores.aux_loss / (steps or 1)
            self._metrics[mode]["aux_loss"].append(scores.aux_loss.detach())  # read back when logged (`log`)
        loss = loss + self.router_terms(model, scores, inputs.get("attention_mask"), real, steps, mode)
        if mode == "eval":
            self._eval_nll += -scores.log_probs.detach().double().sum()
            self._eval_tokens += n
        self._metrics[mode]["mean_token_accuracy"].append(scores.is_top1.sum() / max(1, n))
        self.count_tokens(model, real, slots)
        if mode == "train":
            self._metrics[mode]["num_tokens"] = [self.state.num_input_tokens_seen]
        return (loss, scores) if return_outputs else loss
