"""Checkpoints that exist whole or not at all, which one to resume from, and no checkpoint of a diverged model.

transformers 5.23 writes `checkpoint-N/` in place (weights, optimizer, scheduler, RNG, trainer_state.json last),
and its `get_last_checkpoint` takes the highest N: a process killed mid-save leaves a partial `checkpoint-N` that
resuming would pick. Here every process writes into `tmp-checkpoint-N/checkpoint-N`, and when all are done the main
one renames it to `checkpoint-N`: a dir of that name is complete by construction, and the next run removes
`tmp-*` leftovers. Rotation (`save_total_limit`) runs after the rename (transformers' own runs inside the save,
where it cannot see the new checkpoint), oldest step first, never deleting the checkpoint just saved nor the best.

A non-finite gradient norm stops training before the optimizer applies it (`Diverged`), so no checkpoint holds it.

Sharded runs keep checkpoints sharded: under FSDP with `fsdp_state_dict_type: SHARDED_STATE_DICT` (the shipped
recipes/accelerate/fsdp2.yaml) transformers writes each checkpoint's model and optimizer state with torch's
distributed checkpoint (`pytorch_model_fsdp_0/`, `optimizer_0/`: every rank writes its own shard, nothing is gathered)
and resumes from it. Its `save_model` then writes no model at all; the final save here gathers the full model
once, tensor by tensor onto rank 0 in the dtype the weights have (the recipe's model.dtype), and writes a plain
safetensors model. ZeRO-3 checkpoints are DeepSpeed's own shards already.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch

from erniekit_lite.errors import UserError
from erniekit_lite.files import follow_umask

STATE = "trainer_state.json"  # written last by transformers
STAGING = "tmp-"
_NAME = re.compile(r"^checkpoint-(\d+)$")


class Diverged(Exception):
    """The gradient of step `step` is not finite; the step was not applied."""

    def __init__(self, step: int, grad_norm: float, loss: float):
        super().__init__(f"step {step}: gradient norm {grad_norm}, loss {loss}")
        self.step, self.grad_norm, self.loss = step, grad_norm, loss


def complete(out: Path) -> list[Path]:
    """Complete checkpoints in `out`, oldest step first.

    trainer_state.json is also required because a `checkpoint-N` written before this module (or by plain
    transformers) may be partial; transformers writes that file last.
    """
    out = Path(out)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if (m := _NAME.match(p.name)) and (p / STATE).is_file()]
    return [p for _, p in sorted(found)]


def remove_partial(out: Path, say=print) -> None:
    """Delete what killed saves (or rotations) left: they are never resumed from, and may be large."""
    for leftover in sorted(Path(out).glob(f"{STAGING}checkpoint-*")):
        shutil.rmtree(leftover)
        say(f"removed {leftover}: a checkpoint save that did not finish")


def resume_point(value, out: Path, say=print) -> str | None:
    """`train.resume_from_checkpoint` as the path to load: `auto` (or true) is the newest complete checkpoint."""
    if value is None or value is False:
        return None
    if value is True or value == "auto":
        found = complete(out)
        if not found:
            say(f"resume: no complete checkpoint in {out}; starting from scratch")
            return None
        path = found[-1]
    else:
        path = Path(value)
        if not (path / STATE).is_file():
            newest = complete(out)
            hint = f"; the newest complete one is {newest[-1]}" if newest else ""
            raise UserError(f"train.resume_from_checkpoint: {path} is not a complete checkpoint (no {STATE}){hint}")
    say(f"resuming from {path}")
    return str(path)


class CheckpointMixin:
    """Trainer mixin: atomic checkpoints (see the module docstring), and a stop before a non-finite update."""

    _staging: Path | None = None  # while saving: the dir transformers writes `checkpoint-N` into
    _last_loss = None  # the last micro-batch's loss, for the message when the gradient is not finite
    _diverged_at = None  # on the device: (step, gradient norm, loss) of the first non-finite step, 0s while none

    def _get_output_dir(self, trial) -> str:
        # transformers' `_save_checkpoint` writes `<this>/checkpoint-N`, and rotates checkpoints in <this>
        return str(self._staging) if self._staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        self._check_diverged()  # a checkpoint never follows a step whose gradient was not finite
        run_dir = Path(super()._get_output_dir(trial))
        name = f"checkpoint-{self.state.global_step}"
        staging, final = run_dir / f"{STAGING}{name}", run_dir / name
        self._staging = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging = None
        if getattr(self, "ema", None) is not None:  # train.ema, inside the checkpoint (ema.py)
            self.ema.agree()  # local SGD: the processes' EMAs become one (collective: every process is here)
            if self.args.should_save:
                self.ema.save(staging / name)
        if getattr(self, "sync", None) is not None:  # distributed.sync: each process's own state (sync.py)
            self.sync.save(staging / name)
        if self.state.best_model_checkpoint == str(staging / name):  # the best is this one: name it as it will be
            self.state.best_model_checkpoint = str(final)
            if self.args.should_save:
                self.state.save_to_json(str(staging / name / STATE))
        self.accelerator.wait_for_everyone()  # every process has written its part (RNG states, sharded states)
        if self.args.should_save:
            publish(staging / name, final)
            staging.rmdir()
            keep = {final} | ({Path(self.state.best_model_checkpoint)} if self.state.best_model_checkpoint else set())
            rotate(run_dir, self.args.save_total_limit, keep)
        self.accelerator.wait_for_everyone()

    def save_model(self, output_dir=None, _internal_call=False):
        if not _internal_call and sharded_checkpoints(self):  # the final model, consolidated once (module docstring)
            self._save(output_dir, state_dict=self.accelerator.get_state_dict(self.model))
            return
        super().save_model(output_dir, _internal_call)

    def _issue_warnings_after_load(self, load_result) -> None:
        """A tied LM head is not in a checkpoint (the embedding is written once, as `save_pretrained` does): its
        missing key on resume is the design, not a warning."""
        config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
        if getattr(config, "tie_word_embeddings", False):
            missing = [k for k in load_result.missing_keys if not k.endswith("lm_head.weight")]
            load_result = SimpleNamespace(missing_keys=missing, unexpected_keys=load_result.unexpected_keys)
        super()._issue_warnings_after_load(load_result)

    def _save(self, output_dir=None, state_dict=None):
        """A gathered full state dict (FSDP, ZeRO-3) holds a tied LM head as its own tensor, which `save_pretrained`
        then writes twice; the tie is restored, so the saved model has the layout (and size) of an unsharded run."""
        if state_dict is not None and "lm_head.weight" in state_dict:
            model = self.accelerator.unwrap_model(self.model)
            config = getattr(model, "config", None)
            embed = state_dict.get("model.embed_tokens.weight")
            if getattr(config, "tie_word_embeddings", False) and embed is not None and torch.equal(embed, state_dict["lm_head.weight"]):
                state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
        saved = super()._save(output_dir, state_dict=state_dict)
        follow_umask(Path(output_dir if output_dir is not None else self.args.output_dir))  # safetensors wrote 0600
        return saved

    def training_step(self, *args, **kwargs):
        self._last_loss = loss = super().training_step(*args, **kwargs)
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        """The global gradient norm, checked before the optimizer applies it.

        Every process sees the same norm, so all stop after the same step, and the weights in memory and in every
        checkpoint never hold a NaN/inf update. Under fp16 the loss scaler skips such steps itself.

        With torch's fused Adam/AdamW (the Trainer's default optimizer) the check stays on the device: a non-finite
        norm sets the optimizer's `found_inf`, which skips that step's update in the kernel (weights, moments and
        step count untouched, as under a loss scaler), and the first such step is noted on the device; the run stops
        at the next logging step or checkpoint, naming it (`_check_diverged`). Any other optimizer: the norm is read
        on the host at every step.
        """
        grad_norm = super()._get_grad_norm(model, grad_norm)
        if grad_norm is None or self.args.fp16:
            return grad_norm
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # under accelerate's wrapper
        # a plain tensor: FSDP2's norm is a DTensor, which mixes with no other tensor (read on the host below)
        if type(grad_norm) is torch.Tensor and isinstance(optimizer, torch.optim.Adam) and optimizer.defaults.get("fused"):
            bad = ~torch.isfinite(grad_norm.detach().float())
            optimizer.found_inf = bad.float()
            norm = grad_norm.detach().float()
            # the step filled in on the device (`new_full`): `torch.tensor(..., device=)` copies from the host and waits
            noted = torch.stack([norm.new_full((), self.state.global_step + 1.0), norm, self._last_loss.detach().float().reshape(())])
            before = torch.zeros_like(noted) if self._diverged_at is None else self._diverged_at
            self._diverged_at = torch.where(bad & (before[0] == 0), noted, before)
            return grad_norm
        finite = math.isfinite(float(grad_norm))
        if self._apart():  # local SGD: each process's own norm; all stop together, or the others wait in a collective
            flag = torch.tensor([0.0 if finite else 1.0], device=grad_norm.device if torch.is_tensor(grad_norm) else "cpu")
            torch.distributed.all_reduce(flag, torch.distributed.ReduceOp.MAX)
            if flag.item() and finite:
                raise Diverged(self.state.global_step + 1, float("nan"), float(self._last_loss))
        if not finite:
            raise Diverged(self.state.global_step + 1, float(grad_norm), float(self._last_loss))
        return grad_norm

    def _apart(self) -> bool:
        """Whether the processes' gradient norms differ: local SGD, where each steps on its own gradients."""
        sync = getattr(self, "sync", None)
        return sync is not None and sync.section.sync == "local_sgd"

    def log(self, logs: dict, start_time: float | None = None) -> None:
        self._check_diverged()  # a logging step reads values back anyway
        super().log(logs, start_time)

    def _check_diverged(self) -> None:
        """Stops the run at the first step whose gradient norm was not finite (noted on the device)."""
        if self._diverged_at is not None:
            noted = [self._diverged_at]
            if self._apart():  # local SGD: the first step any process noted, so all stop together (this read's collective)
                noted = [torch.zeros_like(self._diverged_at) for _ in range(torch.distributed.get_world_size())]
                torch.distributed.all_gather(noted, self._diverged_at)
            found = [row for row in torch.stack(noted).tolist() if row[0]]
            if found:
                step, grad_norm, loss = min(found)
                raise Diverged(int(step), grad_norm, loss)


def sharded_checkpoints(trainer) -> bool:
    """Whether the trainer's checkpoints hold sharded model state: FSDP with a sharded state dict type."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return plugin is not None and "SHARDED_STATE_DICT" in str(plugin.state_dict_type)


def publish(staging: Path, final: Path) -> None:
    """Make the staged checkpoint `final` in one rename, its files on disk first (a crash keeps them whole)."""
    for path in [*staging.rglob("*"), staging]:
        _fsync(path)
    if final.exists():  # a step saved again after resuming from an earlier checkpoint
        _discard(final)
    os.replace(staging, final)
    _fsync(final.parent)


def rotate(out: Path, limit: int | None, keep: set[Path]) -> None:
    """Delete the oldest complete checkpoints beyond `limit`, never one in `keep`."""
    if not limit or limit <= 0:
        return
    checkpoints = complete(out)
    surplus = len(checkpoints) - max(limit, len(keep))
    for path in checkpoints:
        if surplus <= 0:
            break
        if path not in keep:
            _discard(path)
            surplus -= 1


def _discard(checkpoint: Path) -> None:
    # Renamed first: a deletion killed half-way leaves a `tmp-` leftover (removed when training next starts), never
    # a `checkpoint-N` that still has its trainer_state.json but lost other files
    doomed = checkpoint.with_name(f"{STAGING}{checkpoint.name}-deleted")
    os.replace(checkpoint, doomed)
    shutil.rmtree(doomed)


def _fsync(path: Path) -> None:
    if os.name != "posix" and path.is_dir():  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
