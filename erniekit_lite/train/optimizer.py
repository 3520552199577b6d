"""The optimizer of every trainer (SFT, pt, DPO, ...): LoRA+ when the adapter asks for it, stepped on the host with
train.offload: optimizer (train/offload.py's HostStep, around whichever optimizer the Trainer or LoRA+ built).

LoRA+: the optimizer is peft's `create_loraplus_optimizer`, built with the
Trainer's own optimizer class and arguments (train.optim, learning_rate, weight_decay, adam betas and epsilon).

peft groups the trainable parameters: every `lora_B` and every 1-D parameter (DoRA's magnitudes) learns at
learning_rate x `lora.plus_lr_ratio`, the rest (`lora_A`) at learning_rate; weight decay is train.weight_decay on
both (peft's `loraplus_weight_decay`). The schedule scales each group's rate, so the ratio holds at every step.
The ratio is the trainer's `lora_plus_ratio`, which the run sets from its plan (train/run.py).
"""

from __future__ import annotations

import contextlib
from unittest import mock

from erniekit_lite.errors import UserError


def lora_plus(trainer, model=None):
    """peft's LoRA+ optimizer with the Trainer's own optimizer class and arguments (the module doc)."""
    from peft.optimizers import create_loraplus_optimizer
    from transformers.trainer_optimizer import is_optimizer_factory

    opt_model = trainer.model if model is None else model
    if trainer.optimizer_cls_and_kwargs is not None:
        optimizer_cls, kwargs = trainer.optimizer_cls_and_kwargs
    else:
        optimizer_cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, opt_model)
    kwargs = dict(kwargs)
    if is_optimizer_factory(optimizer_cls) or {"params", "model", "optimizer_dict"} & kwargs.keys():
        optim = getattr(trainer.args.optim, "value", trainer.args.optim)
        raise UserError(f"lora.plus_lr_ratio: train.optim {optim} builds its own parameter groups; LoRA+ needs a "
                        "plain optimizer (adamw_torch, adamw_torch_fused, adamw_8bit, sgd, ...)")
    lr = kwargs.pop("lr", trainer.args.learning_rate)
    return create_loraplus_optimizer(opt_model, optimizer_cls, lr=lr, loraplus_lr_ratio=trainer.lora_plus_ratio,
                                     loraplus_weight_decay=trainer.args.weight_decay, **kwargs)


def check_deepspeed(trainer) -> None:
    """A DeepSpeed config with its own `optimizer` block makes DeepSpeed build the optimizer: `create_optimizer` (and
    with it LoRA+) would never run."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if trainer.lora_plus_ratio is not None and plugin is not None and "optimizer" in (plugin.deepspeed_config or {}):
        raise UserError("lora.plus_lr_ratio: the DeepSpeed config has its own optimizer block, which replaces the "
                        "Trainer's optimizer (and LoRA+); remove that block or lora.plus_lr_ratio")


@contextlib.contextmanager
def loaded_on_host():
    """transformers loads a multi-process run's optimizer state onto the GPU first (trainer.py), a full copy the host
    step exists to keep off it: within, `torch.load` maps it to the host instead."""
    import torch

    load = torch.load
    with mock.patch.object(torch, "load", lambda *a, **k: load(*a, **{**k, "map_location": "cpu"})):
        yield
