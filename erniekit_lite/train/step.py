"""What every Trainer of the project adds to the step, whatever computes the loss: the project's Trainer
(train/trainer.py: every method but GRPO) and GRPO's adapter onto TRL (train/grpo_trainer.py) both put
`ErnieTrainer` first. Per optimizer step, in this order:

1. per micro-batch, `training_step` -> `_prepare_inputs` (accelerate moves the batch; the host-counted sample lengths
   are handed to per-sample attention, `attention.take_batch_lengths`) -> the loss (`Trainer.compute_loss`, or TRL's
   for GRPO), `count_tokens` -> backward (the Trainer's); the first step's out-of-memory retry wraps this, the one
   re-decision a run makes (below);
2. `_get_grad_norm`: clipping, and the divergence guard (`checkpoints.DivergenceGuard`: on the device with fused
   AdamW, so the step does not wait);
3. the optimizer (`create_optimizer`: LoRA+ when the adapter asks, the host step under `train.offload: optimizer`);
4. the callbacks at step end, in the order `train/run.py` adds them: weight EMA (after any sync, so it reads averaged
   weights), the slow-link sync, the first-step and stop-on-signal bookkeeping;
5. `log` at logging steps only: the divergence guard read, real-token rates.

Checkpoints are atomic (`checkpoints.py`: written into `tmp-checkpoint-N/`, renamed whole), and a PiSSA/OLoRA
adapter is saved as a plain LoRA at the end (`lora.save_as_plain_lora`). Everything else (schedule, accumulation,
mixed precision) is transformers'.
"""

from __future__ import annotations

import copy
import json
import gc
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from erniekit_lite.errors import UserError
from erniekit_lite.files import follow_umask
from erniekit_lite.model.attention import take_batch_lengths
from erniekit_lite.model.expert_lora import forget_layouts, layout_holders
from erniekit_lite.model.lora import save_as_plain_lora, unwrap
from erniekit_lite.run_plan import CHECKPOINTING_OFF_BY_PLAN
from erniekit_lite.train import checkpoints, offload, optimizer

# What a micro-batch's training step adds to, put back before the first step's batches run again: the real-token
# counts, the metrics kept for the next log (the project's `metrics`, TRL's `_metrics` in GRPO), GRPO's micro-step
# counter (it picks the buffered generation) and step time
_STEP_STATE = ("real_tokens", "token_slots", "_since_log", "metrics", "_metrics", "_step", "_current_train_step_time")
RETRIED_AT = "activation_checkpointing_turned_on_at_step"  # train_results.json: the first step ran out of memory
TOTALS = "erniekit_totals.json"  # in a checkpoint: the run so far over all processes, rank 0's (`_RunTotals`)
TOTALS_PER_RANK = "erniekit_totals-rank*.json"  # older checkpoints: one per process, its own counts (`read_totals`)


class ErnieTrainer:
    """Placed before a Trainer class (see the module doc). What it owns: the divergence guard, the real-token
    counters, the first step's batches (for the out-of-memory retry) and, while saving, the staging dir."""

    real_tokens = 0  # non-pad tokens forwarded in training
    token_slots = 0  # tokens the batches could hold (rows x row capacity when packed; padded size otherwise)
    _since_log = None  # (time, real_tokens, token_slots) at the previous log
    retried_at: int | None = None  # the step that ran out of memory and ran again
    _first: tuple[int, dict, list] | None = None  # first step: (global step before it, state before it, its batches)
    _micro_batch = None  # the micro-batch `training_step` is running (as the Trainer fetched it)
    _staging: Path | None = None  # while saving: the dir transformers writes `checkpoint-N` into
    resumed_totals: dict | None = None  # what the checkpoint a run resumes from says of the run before it
    _carried_tokens = (0, 0)  # (real tokens, slots) of the run before the resume, over all processes (`_RunTotals`)
    _train_started: float | None = None  # this call's training clock
    ema = None  # train.ema's callback (ema.py), read by the checkpoints
    sync = None  # distributed.sync's callback (sync.py), read by the checkpoints and the guard
    lora_plus_ratio: float | None = None  # lora.plus_lr_ratio, from the run plan (train/run.py): LoRA+ (optimizer.py)
    initial_adapter: dict | None = None  # PiSSA/OLoRA's adapter before training (model/lora.py), for the final save
    sequence_parallel = 1  # distributed.sequence_parallel: the processes that count each row (train/sequence_parallel.py)

    def __init__(self, *args, **kwargs):
        self.guard = checkpoints.DivergenceGuard()
        super().__init__(*args, **kwargs)

    # --- the step ----------------------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-batch: forward, loss and backward (TRL's and the Trainer's `training_step`).

        A first optimizer step that runs out of memory with activation checkpointing off, where the memory plan turned
        it off (`run_plan.resolve`, one process), is the one re-decision a run makes: checkpointing goes on as
        transformers turns it on, a trained LM head recomputes its chunks, the step's gradients so far are zeroed and
        its micro-batches run again from the first, counters as before the step. Any other first-step out-of-memory
        ends the run with one line naming the settings that lower memory. The Trainer's loop, its loss sum and the
        optimizer step are left as they are."""
        if self._first is None:
            self._first = (self.state.global_step, self._step_state(), [])
        step, before, batches = self._first
        if self.state.global_step != step:
            batches.clear()  # past the first step: the Trainer's batches are not held here any longer
            return self._micro_step(model, inputs, num_items_in_batch)
        batches.append((inputs, num_items_in_batch))
        try:
            return self._micro_step(model, inputs, num_items_in_batch)
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

    def _micro_step(self, model, inputs, num_items_in_batch):
        self._micro_batch = inputs
        self.guard.last_loss = loss = super().training_step(model, inputs, num_items_in_batch)
        return loss

    def _prepare_inputs(self, inputs):
        # The sample lengths the collator counted on the CPU (`collate.host_facts`) are handed to per-sample attention
        # once the batch is on the device, so no step reads them back (a host sync each)
        return take_batch_lengths(super()._prepare_inputs(inputs))

    def get_train_dataloader(self):
        return self._by_groups(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._by_groups(super().get_eval_dataloader(eval_dataset))

    def _by_groups(self, loader):
        # distributed.sequence_parallel: the processes of a group read the same batches (train/sequence_parallel.py)
        if self.sequence_parallel == 1:
            return loader
        from erniekit_lite.train.sequence_parallel import by_groups

        return by_groups(loader, self.accelerator, self.sequence_parallel)

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm)
        if grad_norm is None or self.args.fp16:
            return grad_norm
        return self.guard.norm(grad_norm, self.optimizer, self.state.global_step + 1, self._apart())

    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return super().create_optimizer(model)
        if self.lora_plus_ratio is None:
            super().create_optimizer(model)
        else:
            self.optimizer = optimizer.lora_plus(self, model)
        if offload.applied(self.args).mode == "optimizer":
            self.optimizer = offload.HostStep(self.optimizer)
        return self.optimizer

    def count_tokens(self, model, real: int, slots: int) -> None:
        """A training micro-batch's real tokens and the slots its batch could hold (host numbers, from the collator)."""
        if model.training:
            if self._since_log is None:  # the first training forward starts the clock
                self._since_log = (time.perf_counter(), self.real_tokens, self.token_slots)
            self.real_tokens += real
            self.token_slots += int(slots)
            # Kept in the TrainerState, so checkpoints carry it and a resumed run counts on from there (the
            # Trainer itself updates it only with include_num_input_tokens_seen, which counts pads too)
            self.state.num_input_tokens_seen += real

    def log(self, logs: dict, start_time: float | None = None) -> None:
        self.guard.check(self._apart())  # a logging step reads values back anyway
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

    def train(self, resume_from_checkpoint=None, **kwargs):
        optimizer.check_deepspeed(self)
        holders = layout_holders(self.model)  # expert adapters keep layouts from one optimizer step to the next
        if holders:
            self.add_callback(_FreshExpertLayouts(holders))
        self.add_callback(_RunTotals(self))
        self.resumed_totals = read_totals(resume_from_checkpoint, self.sequence_parallel) if resume_from_checkpoint else None
        try:
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        except torch.OutOfMemoryError:
            if self._first is None or self.state.global_step != self._first[0]:
                raise  # before the first micro-batch, or after the first step: not the first step's memory
            failed = self._first[0] + 1
            output = None
        if output is None:
            raise UserError(self._lower_memory(failed)) from None
        if self.sequence_parallel > 1:  # the Trainer counts every process's batches: a group's N share each row
            output.metrics["train_samples_per_second"] = round(output.metrics["train_samples_per_second"] / self.sequence_parallel, 3)
        if self.resumed_totals is not None:  # the whole run's time: the Trainer timed this call alone
            metrics, before = output.metrics, self.resumed_totals["runtime"]
            runtime = metrics["train_runtime"] + before
            metrics["train_samples_per_second"] = round(metrics["train_samples_per_second"] * metrics["train_runtime"] / runtime, 3)
            metrics["train_steps_per_second"] = round(self.state.global_step / runtime, 3)
            metrics["train_runtime"] = round(runtime, 4)
        return output

    # --- what train_results.json reads ---------------------------------------------------------------------------

    def throughput(self, runtime: float) -> dict:
        real, slots = self._run_tokens()
        return {
            "train_tokens": real,
            "train_tokens_per_second": round(real / runtime, 2) if runtime else 0.0,
            "packing_efficiency": round(real / slots, 4) if slots else 0.0,
        }

    def retry_metrics(self) -> dict:
        """The step that ran out of memory and ran again with checkpointing on, if any."""
        return {RETRIED_AT: self.retried_at} if self.retried_at is not None else {}

    # --- saving ----------------------------------------------------------------------------------------------------

    def _get_output_dir(self, trial) -> str:
        # transformers' `_save_checkpoint` writes `<this>/checkpoint-N`, and rotates checkpoints in <this>
        return str(self._staging) if self._staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """Atomic (checkpoints.py): every process writes into `tmp-checkpoint-N/checkpoint-N`, then one rename. The
        run's totals over all processes go with it (`_RunTotals`)."""
        self.guard.check(self._apart())  # a checkpoint never follows a step whose gradient was not finite
        run_dir = Path(super()._get_output_dir(trial))
        name = f"checkpoint-{self.state.global_step}"
        staging, final = run_dir / f"{checkpoints.STAGING}{name}", run_dir / name
        self._staging = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging = None
        if self.ema is not None:  # train.ema, inside the checkpoint (ema.py)
            self.ema.agree()  # local SGD: the processes' EMAs become one (collective: every process is here)
            if self.args.should_save:
                self.ema.save(staging / name)
        if self.sync is not None:  # distributed.sync: each process's own state (sync.py)
            self.sync.save(staging / name)
        (staging / name).mkdir(parents=True, exist_ok=True)
        totals = self._run_totals()  # collective: every process is here
        if self.args.should_save:
            (staging / name / TOTALS).write_text(json.dumps(totals))
        if self.state.best_model_checkpoint == str(staging / name):  # the best is this one: name it as it will be
            self.state.best_model_checkpoint = str(final)
            if self.args.should_save:
                self.state.save_to_json(str(staging / name / checkpoints.STATE))
        self.accelerator.wait_for_everyone()  # every process has written its part (RNG states, sharded states)
        if self.args.should_save:
            checkpoints.publish(staging / name, final)
            staging.rmdir()
            keep = {final} | ({Path(self.state.best_model_checkpoint)} if self.state.best_model_checkpoint else set())
            checkpoints.rotate(run_dir, self.args.save_total_limit, keep)
        self.accelerator.wait_for_everyone()

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None or offload.host_step(self.optimizer) is None or self.args.world_size == 1:
            return super()._load_optimizer_and_scheduler(checkpoint)
        with optimizer.loaded_on_host():
            return super()._load_optimizer_and_scheduler(checkpoint)

    def _issue_warnings_after_load(self, load_result) -> None:
        super()._issue_warnings_after_load(checkpoints.tied_head_expected(load_result, self.accelerator.unwrap_model(self.model)))

    def save_model(self, output_dir=None, _internal_call: bool = False):
        if not _internal_call and checkpoints.sharded_checkpoints(self):  # the final model, consolidated once
            self._save(output_dir, state_dict=self.accelerator.get_state_dict(self.model))
            return
        super().save_model(output_dir, _internal_call)
        # PiSSA/OLoRA changed the base weights in memory: the run's final adapter is written as a plain LoRA on the
        # unchanged base; checkpoints (`_internal_call`) keep peft's own form, which resuming loads into that base
        if self.initial_adapter is not None and not _internal_call and self.args.should_save:
            save_as_plain_lora(output_dir if output_dir is not None else self.args.output_dir, self.initial_adapter)

    def _save(self, output_dir=None, state_dict=None):
        state_dict = checkpoints.without_tied_head(state_dict, self.accelerator.unwrap_model(self.model))
        saved = super()._save(output_dir, state_dict=state_dict)
        follow_umask(Path(output_dir if output_dir is not None else self.args.output_dir))  # safetensors wrote 0600
        return saved

    def _run_totals(self) -> dict:
        """What a resumed run needs to report the whole run (`_RunTotals`), the same on every process, so a run that
        resumes with another process count reads it alike: the loss summed over the logged windows (each already the
        processes' mean), the window not yet logged as its mean over the processes (what the next log would gather),
        the step of the last log, the real tokens and slots summed over the processes, the seconds trained (this
        process's clock). Collective, read at a checkpoint, which reads the device anyway."""
        carried = self.resumed_totals["runtime"] if self.resumed_totals is not None else 0.0
        window = self._tr_loss.detach()
        if self.accelerator.num_processes > 1:
            window = self.accelerator.reduce(window.clone(), reduction="mean")
        real, slots = self._run_tokens()
        return {"loss_logged": self._total_loss_scalar, "loss_window": float(window),
                "last_logged": self._globalstep_last_logged, "real_tokens": real, "token_slots": slots,
                "runtime": carried + (time.perf_counter() - self._train_started if self._train_started else 0.0)}

    # --- helpers -----------------------------------------------------------------------------------------------------

    def _apart(self) -> bool:
        """Whether the processes' gradient norms differ: local SGD, where each steps on its own gradients."""
        return self.sync is not None and self.sync.section.sync == "local_sgd"

    def _run_tokens(self) -> tuple[int, int]:
        """The run's real tokens and slots over all processes, the run before a resume's included (collective)."""
        real, slots = self._all_processes(self.real_tokens, self.token_slots)
        return real + self._carried_tokens[0], slots + self._carried_tokens[1]

    def _all_processes(self, real: int, slots: int) -> tuple[int, int]:
        """Token counts summed over the processes of a launched run (each counts its own batches; the processes of a
        sequence group each count their group's rows)."""
        if self.accelerator.num_processes == 1:
            return real, slots
        total = self.accelerator.reduce(torch.tensor([real, slots], device=self.accelerator.device), reduction="sum")
        return int(total[0]) // self.sequence_parallel, int(total[1]) // self.sequence_parallel

    def _may_retry(self) -> bool:
        return (getattr(self.args, CHECKPOINTING_OFF_BY_PLAN, False) and not self.args.activation_checkpointing
                and not self.is_deepspeed_enabled)  # DeepSpeed accumulates gradients in its own buffers

    def _checkpointing_on(self, step: int) -> None:
        """Activation checkpointing as `Trainer.train` turns it on (and TRL, for an adapter), and the LM head's chunks
        recomputed (`run_plan.RunPlan.head_keep_positions`); said in one line."""
        kwargs = dict(self.args.activation_checkpointing_kwargs or {})
        every, offload_ = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
        self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None, every_n_layers=every,
                                                   offload=offload_)
        if hasattr(self.model, "peft_config"):
            self.model.enable_input_require_grads()
        self.args.activation_checkpointing = self.args.gradient_checkpointing = True
        base = unwrap(self.model)
        head = ", the LM head's chunks recomputed" if getattr(base, "head_keep_positions", 0) else ""
        if head:
            base.head_keep_positions = 0
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


class _RunTotals(TrainerCallback):
    """A resumed run goes on with the totals its checkpoint holds (`ErnieTrainer._run_totals`), so its logs, its mean
    loss, tokens and runtime are the uninterrupted run's, with any process count: the Trainer's own start-of-training
    state (transformers 5.23's `_tr_loss`, `_total_loss_scalar`, `_globalstep_last_logged`, `_initial_global_step`)
    set from them once it has made it, on every process. Each process's unlogged window starts at the processes'
    mean (the next log gathers the mean of the windows: that mean plus the steps after the resume), and the tokens
    before the resume are added once, after the sum over the processes. A checkpoint without them (written before
    they were kept) resumes as before: totals of this call alone."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        trainer, saved = self.trainer, self.trainer.resumed_totals
        trainer._train_started = time.perf_counter()
        if saved is None:
            return
        trainer._total_loss_scalar = saved["loss_logged"]
        trainer._tr_loss += saved["loss_window"]  # the window cut by the stop: the next log averages all of it
        trainer._globalstep_last_logged = saved["last_logged"]
        trainer._initial_global_step = 0  # the mean loss and samples over the whole run
        trainer._carried_tokens = (saved["real_tokens"], saved["token_slots"])


def read_totals(checkpoint, sequence_parallel: int = 1) -> dict | None:
    """The run's totals in a checkpoint (`ErnieTrainer._run_totals`), or None where it has none. An older checkpoint
    holds one file per process, each with its own window and tokens (`TOTALS_PER_RANK`): read all of them and combined
    as one file holds them (the windows' mean, the tokens' sum over the `sequence_parallel` processes counting each
    row, as this run counts them), so it resumes with any process count too."""
    folder = Path(str(checkpoint))
    if (folder / TOTALS).is_file():
        return json.loads((folder / TOTALS).read_text())
    ranks = {p.stem.rsplit("-rank", 1)[1]: p for p in folder.glob(TOTALS_PER_RANK)}
    if not ranks:
        return None
    each = [json.loads(ranks[r].read_text()) for r in sorted(ranks, key=lambda r: int(r) if r.isdigit() else -1)]
    return {**each[0], "loss_window": sum(t["loss_window"] for t in each) / len(each),
            "real_tokens": sum(t["real_tokens"] for t in each) // sequence_parallel,
            "token_slots": sum(t["token_slots"] for t in each) // sequence_parallel}


class _FreshExpertLayouts(TrainerCallback):
    """After each optimizer step (DeepSpeed's included: its engine steps in backward, before this), the expert
    adapters' kept layouts are dropped (`expert_lora.forget_layouts`); the next forward lays them out anew."""

    def __init__(self, holders: list):
        self.holders = holders

    def on_optimizer_step(self, args, state, control, **kwargs):
        forget_layouts(self.holders)


def real_tokens(inputs: dict, side: str = "") -> int:
    """The non-pad tokens of a batch (popped): as the collator counted them (`collate.host_facts`), else counted here,
    a read from the device, for a batch some other collator made."""
    real = inputs.pop(f"{side}real_tokens", None)
    if real is None:
        mask = inputs.get(f"{side}attention_mask")
        real = int(mask.sum()) if mask is not None else inputs[f"{side}input_ids"].numel()
    return real
