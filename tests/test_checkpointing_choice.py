"""Activation checkpointing on a GPU when the recipe leaves it unset: off when the memory plan fits without it
(TRL's default recomputes every layer), on when it does not, and never overriding a recipe's own choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from erniekit_lite import memory
from erniekit_lite.run_plan import CHECKPOINTING_OFF_BY_PLAN, HEADROOM, architecture, choose_checkpointing, memory_estimate
from erniekit_lite.recipe import from_dict
from erniekit_lite.trainer_args import training_args

ROOT = Path(__file__).resolve().parents[1]


def _recipe(model_dir, tmp_path, **train):
    return from_dict({
        "model": {"path": str(model_dir)},
        "data": {"train": [str(ROOT / "recipes" / "data" / "identity.jsonl")], "max_length": 1024},
        "lora": {"r": 8},
        "train": {"per_device_train_batch_size": 4, **train},
        "output": {"dir": str(tmp_path / "out")},
    })


def _needed_without(recipe, args) -> int:
    args.activation_checkpointing = False
    need = memory_estimate(recipe, args, architecture(recipe.model.path, recipe), cuda=True)[0].total
    args.activation_checkpointing = True
    return need


def test_turned_off_only_when_the_run_fits_without_it(tiny_dense_dir, tmp_path):
    recipe = _recipe(tiny_dense_dir, tmp_path)
    args = training_args(recipe, tmp_path / "out")
    assert args.activation_checkpointing  # TRL's default
    need = _needed_without(recipe, args)
    said, arch = [], architecture(recipe.model.path, recipe)
    choose_checkpointing(recipe, args, arch, int(need / HEADROOM) + memory.GIB, said.append)
    assert args.activation_checkpointing is False and "activation checkpointing off" in said[0]
    assert getattr(args, CHECKPOINTING_OFF_BY_PLAN) is True  # a first step out of memory turns it back on (test_oom_retry.py)
    args = training_args(recipe, tmp_path / "out")
    choose_checkpointing(recipe, args, arch, int(need / HEADROOM) - 1, said.append)
    assert args.activation_checkpointing is True and len(said) == 1
    assert not hasattr(args, CHECKPOINTING_OFF_BY_PLAN)


@pytest.mark.parametrize("setting", [True, False])
def test_a_recipes_own_choice_is_kept(tiny_dense_dir, tmp_path, setting):
    recipe = _recipe(tiny_dense_dir, tmp_path, activation_checkpointing=setting)
    args = training_args(recipe, tmp_path / "out")
    choose_checkpointing(recipe, args, architecture(recipe.model.path, recipe), 10**15)
    assert args.activation_checkpointing is setting


def test_trained_lm_head_keeps_its_chunks_only_when_the_plan_fits(tiny_dense_dir, tmp_path):
    """Full fine-tuning: the head's chunk buffers stay for backward when the plan with them kept, weights included,
    fits the memory free before the model loads (the positions a micro-batch can score), else every chunk is
    recomputed (0)."""
    from erniekit_lite.run_plan import head_keep_positions

    recipe = _recipe(tiny_dense_dir, tmp_path).model_copy(update={"lora": None})
    args = training_args(recipe, tmp_path / "out")
    arch = architecture(recipe.model.path, recipe)
    keep, run = memory_estimate(recipe, args, arch, cuda=True, head_keep=True)
    recompute, _ = memory_estimate(recipe, args, arch, cuda=True, head_keep=False)
    assert keep.logits >= 4 * run.tokens * arch["shape"].vocab > 10 * recompute.logits  # every chunk's fp32 buffer
    assert keep.total > recompute.total
    said, need = [], keep.total  # decided in the run plan, before the weights load
    assert head_keep_positions(recipe, args, arch, int(need / HEADROOM) + 1, said.append) == 4 * 1024
    assert head_keep_positions(recipe, args, arch, int(need / HEADROOM) - 1, said.append) == 0
    assert "kept for backward" in said[0] and "recomputed in backward" in said[1]


def test_the_choice_reads_free_device_memory_not_its_total(monkeypatch):
    """A stand-in GPU of 80 GiB with 3 GiB free (another process holds the rest): the plans are checked against the
    3 GiB. On CPU the memory available now."""
    import psutil
    import torch

    from erniekit_lite.train.common import free_memory

    assert free_memory() == pytest.approx(psutil.virtual_memory().available, rel=0.05)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * memory.GIB, 80 * memory.GIB))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: pytest.fail("read the total"))
    assert free_memory() == 3 * memory.GIB

