"""A training step that never waits for the host (issue 44): calls that read a device tensor on the host, counted
per optimizer step on CPU.

A dispatch mode counts the aten calls that make the host wait for the device on a GPU: `_local_scalar_dense` (a
tensor read as a Python number: `.item()`, `float()`, `bool()`, an `if` on a tensor), `nonzero`, `masked_select`,
boolean-mask indexing, `bincount`, `unique`, `repeat_interleave` without an output size. Runs of N and 2N optimizer
steps (accumulation 1, no logging step in between, no checkpoint) are counted and the difference divided by N, so
set-up and the end of training cancel out. Calls made while the batch is still on the host are not syncs there and
are left out: the collators, the dataloader and `scoring.with_score_positions` (before the batch moves). The
method cannot see `.tolist()`, `.cpu()` or `.numpy()` of a tensor that lives on the GPU; those are found by reading.

Covered so far: SFT, full fine-tuning and LoRA, on the tiny dense model. The preference methods, GRPO and the MoE
are counted by the same helper once theirs are gone (issue 44 lists them).
"""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from erniekit_lite.cli import main
from erniekit_lite.train import callbacks
from helpers import write_recipe

SYNCING = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::bincount", "aten::_unique2",
           "aten::unique_consecutive", "aten::unique_dim", "aten::repeat_interleave"}
INDEXING = {"aten::index.Tensor", "aten::index_put_", "aten::index_put"}
ON_THE_HOST = ("erniekit_lite/data/", "accelerate/data_loader.py", "torch/utils/data/", "with_score_positions")


class Syncs(TorchDispatchMode):
    """Sync-making calls, each under the nearest frame of this project or a library it uses."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        boolean = name in INDEXING and any(t is not None and t.dtype == torch.bool for t in args[1])
        if name in SYNCING or boolean:
            stack = traceback.extract_stack()[:-1]
            if not any(host in f.filename or host == f.name for f in stack for host in ON_THE_HOST):
                frames = [f for f in stack if "/torch/" not in f.filename]
                where = frames[-1] if frames else stack[-1]
                self.calls[f"{name} at {where.filename.split('site-packages/')[-1]}:{where.lineno} ({where.name})"] += 1
        return func(*args, **(kwargs or {}))


def syncs_per_step(tmp_path, monkeypatch, recipe_of, steps: int = 3) -> dict[str, float]:
    counted, train = {}, callbacks.train

    def counting(trainer, out, resume=None):
        with Syncs() as syncs:
            result = train(trainer, out, resume)
        counted[out.name] = syncs.calls
        return result

    monkeypatch.setattr(callbacks, "train", counting)
    for n in (steps, 2 * steps):
        assert main(["train", str(recipe_of(tmp_path / f"r{n}.yaml", tmp_path / f"run{n}", n))]) == 0
    few, many = counted[f"run{steps}"], counted[f"run{2 * steps}"]
    return {k: (many[k] - few[k]) / steps for k in few.keys() | many.keys() if many[k] != few[k]}


@pytest.mark.parametrize("lora", [None, {"r": 4}], ids=["full", "lora"])
def test_an_sft_step_reads_nothing_back_from_the_device(tmp_path, monkeypatch, tiny_own_dir, lora):
    """Before, each step read back: the LM head's underflow branch, the NaN/inf filter's two reads of each
    micro-batch's loss, the token accuracy's `.item()`, the divergence guard's `float(grad_norm)`, and the boolean
    mask of trained positions (its forward and backward)."""

    def recipe_of(path, out, steps):
        return write_recipe(path, tiny_own_dir, lora=lora, out=out,
                            train={"max_steps": steps, "logging_steps": 1000, "save_strategy": "no", "learning_rate": 1e-3,
                                   "per_device_train_batch_size": 1})

    assert syncs_per_step(tmp_path, monkeypatch, recipe_of) == {}
