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


class DivergenceGuard:
    """The stop before a non-finite update, owned by the run's Trainer (`step.ErnieTrainer`).

    Every process sees the same gradient norm, so all stop after the same step, and the weights in memory and in every
    checkpoint never hold a NaN/inf update. Under fp16 the loss scaler skips such steps itself.

    With torch's fused Adam/AdamW (the Trainer's default optimizer) the check stays on the device: a non-finite norm
    sets the optimizer's `found_inf`, which skips that step's update in the kernel (weights, moments and step count
    untouched, as under a loss scaler), and the first such step is noted on the device; the run stops at the next
    logging step or checkpoint, naming it (`check`). The host step (`train.offload: optimizer`, which waits for the
    device once a step anyway): the norm travels to the host with the gradients and is checked there, before the step.
    Any other optimizer: the norm is read on the host at every step.
    `apart`: local SGD, where each process's norm is its own (all stop together, or the others wait in a collective).
    """

    def __init__(self):
        self.last_loss = None  # the last micro-batch's loss, for the message when the gradient is not finite
        self.noted = None  # on the device: (step, gradient norm, loss) of the first non-finite step, 0s while none

    def norm(self, grad_norm, optimizer, step: int, apart: bool):
        """The step's gradient norm (`step`: the one about to be applied), checked as the class says."""
        optimizer = getattr(optimizer, "optimizer", optimizer)  # under accelerate's wrapper
        # a plain tensor: FSDP2's norm is a DTensor, which mixes with no other tensor (read on the host below)
        if type(grad_norm) is torch.Tensor and isinstance(optimizer, torch.optim.Adam) and optimizer.defaults.get("fused"):
            bad = ~torch.isfinite(grad_norm.detach().float())
            optimizer.found_inf = bad.float()
            norm = grad_norm.detach().float()
            # the step filled in on the device (`new_full`): `torch.tensor(..., device=)` copies from the host and waits
            noted = torch.stack([norm.new_full((), float(step)), norm, self.last_loss.detach().float().reshape(())])
            before = torch.zeros_like(noted) if self.noted is None else self.noted
            self.noted = torch.where(bad & (before[0] == 0), noted, before)
            return grad_norm
        if isinstance(grad_norm, torch.Tensor) and hasattr(optimizer, "check_norm") and not apart:
            optimizer.check_norm(grad_norm, lambda norm: self._finite(norm, step))  # read with its own wait (offload.py)
            return grad_norm
        finite = math.isfinite(float(grad_norm))
        if apart:
            flag = torch.tensor([0.0 if finite else 1.0], device=grad_norm.device if torch.is_tensor(grad_norm) else "cpu")
            torch.distributed.all_reduce(flag, torch.distributed.ReduceOp.MAX)
            if flag.item() and finite:
                raise Diverged(step, float("nan"), float(self.last_loss))
        if not finite:
            raise Diverged(step, float(grad_norm), float(self.last_loss))
        return grad_norm

    def _finite(self, norm: float, step: int) -> None:
        if not math.isfinite(norm):
            raise Diverged(step, norm, float(self.last_loss))

    def check(self, apart: bool) -> None:
        """Stops the run at the first step whose gradient norm was noted not finite (a read from the device)."""
        if self.noted is None:
            return
        noted = [self.noted]
        if apart:  # local SGD: the first step any process noted, so all stop together (this read's collective)
            noted = [torch.zeros_like(self.noted) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(noted, self.noted)
        found = [row for row in torch.stack(noted).tolist() if row[0]]
        if found:
            step, grad_norm, loss = min(found)
            raise Diverged(int(step), grad_norm, loss)


def without_tied_head(state_dict: dict | None, model) -> dict | None:
    """A gathered full state dict (FSDP, ZeRO-3) holds a tied LM head as its own tensor, which `save_pretrained` then
    writes twice; without it, the saved model has the layout (and size) of an unsharded run."""
    if state_dict is None or "lm_head.weight" not in state_dict:
        return state_dict
    config = getattr(model, "config", None)
    embed = state_dict.get("model.embed_tokens.weight")
    if getattr(config, "tie_word_embeddings", False) and embed is not None and torch.equal(embed, state_dict["lm_head.weight"]):
        return {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    return state_dict


def tied_head_expected(load_result, model):
    """A tied LM head is not in a checkpoint (the embedding is written once, as `save_pretrained` does): its missing key
    on resume is the design, not a warning."""
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        missing = [k for k in load_result.missing_keys if not k.endswith("lm_head.weight")]
        return SimpleNamespace(missing_keys=missing, unexpected_keys=load_result.unexpected_keys)
    return load_result


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
