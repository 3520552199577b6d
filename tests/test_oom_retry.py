"""A first step out of memory (issue 30, item 7). Where the plan turned activation checkpointing off (one process),
the run turns it on, recomputes the LM head's chunks, runs the step's batches again and says so once, in its output
and in train_results.json; otherwise the run ends with one line naming the settings that lower memory.

Stand-ins, both said where used: the GPU plan (`choose_checkpointing` with memory to spare: on CPU `train` never
plans) and the out-of-memory error (`Accelerator.backward` raising `torch.OutOfMemoryError` after writing half of the
micro-batch's gradient, so the step's gradients are partly written when it fails)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from erniekit_lite.run_plan import architecture, choose_checkpointing
from erniekit_lite.train import callbacks, run as runner
from erniekit_lite.train.step import RETRIED_AT
from helpers import run_cli, write_recipe

TRAIN = {"learning_rate": 1e-3, "max_steps": 3, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2,
         "logging_steps": 1, "save_steps": 100, "seed": 0}


def plan_with_room(monkeypatch):
    """Stand-in for a GPU with memory to spare: the plan turns checkpointing off, as on such a GPU."""
    real = runner.run_arguments

    def planned(recipe, out):
        args = real(recipe, out)
        choose_checkpointing(recipe, args, architecture(recipe.model.path, recipe), 10**15, print)
        return args

    monkeypatch.setattr(runner, "run_arguments", planned)


def out_of_memory_at(monkeypatch, *backwards: int) -> list[int]:
    """Stand-in: the n-th backward calls (1-based) write part of their gradient (half of it), then raise
    torch.OutOfMemoryError; the others are the real backward."""
    calls, real = [], Accelerator.backward

    def backward(self, loss, **kwargs):
        calls.append(1)
        if len(calls) not in backwards:
            return real(self, loss, **kwargs)
        real(self, loss / 2, **kwargs)
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(Accelerator, "backward", backward)
    return calls


def seen_at_the_end(monkeypatch) -> SimpleNamespace:
    seen, save_final = SimpleNamespace(), callbacks.save_final

    def spy(trainer, out, metrics, expert_load=None):
        seen.checkpointing = trainer.args.activation_checkpointing
        seen.layers = trainer.model.is_gradient_checkpointing
        seen.head_keep = trainer.model.head_keep_positions
        return save_final(trainer, out, metrics, expert_load)

    monkeypatch.setattr(callbacks, "save_final", spy)
    return seen


def losses(run) -> list[float]:
    return [h["loss"] for h in json.loads((run / "trainer_state.json").read_text())["log_history"] if "loss" in h]


def test_first_step_out_of_memory_turns_checkpointing_on_and_runs_the_same_batches_again(tmp_path, capsys, monkeypatch,
                                                                                          tiny_own_dir):
    """Full fine-tuning (a trained LM head, its chunks kept by the plan), 2 micro-batches per step; the second
    micro-batch's backward runs out of memory. The step's gradients are zeroed and both micro-batches run again:
    losses and token counts equal a run with checkpointing on from the start (doubled gradients or counts would not)."""
    reference = write_recipe(tmp_path / "reference.yaml", tiny_own_dir, out=tmp_path / "reference",
                             train={**TRAIN, "activation_checkpointing": True})
    code, _, err = run_cli(capsys, "train", reference)
    assert code == 0, err

    plan_with_room(monkeypatch)
    calls = out_of_memory_at(monkeypatch, 2)
    seen = seen_at_the_end(monkeypatch)
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_own_dir, out=tmp_path / "run", train=TRAIN)
    code, out, err = run_cli(capsys, "train", recipe)
    assert code == 0, err
    assert "activation checkpointing off: the run needs about" in out  # the plan's choice, then the retry's line
    said = [line for line in out.splitlines() if line.startswith("out of memory")]
    assert said == ["out of memory at step 1 with activation checkpointing off (the memory plan said the run fits): "
                    "turned it on, the LM head's chunks recomputed; running the step's batches again"]
    assert len(calls) == 2 + 3 * 2  # the failed backward, then 3 steps of 2 micro-batches
    assert seen.checkpointing is True and seen.layers is True and seen.head_keep == 0

    results = json.loads((tmp_path / "run" / "train_results.json").read_text())
    expected = json.loads((tmp_path / "reference" / "train_results.json").read_text())
    assert results[RETRIED_AT] == 1 and RETRIED_AT not in expected
    assert results["train_tokens"] == expected["train_tokens"] > 0
    assert len(losses(tmp_path / "run")) == 3
    assert losses(tmp_path / "run") == pytest.approx(losses(tmp_path / "reference"), rel=1e-5)


LOWER = "data.max_length, train.per_device_train_batch_size (now 1; train.gradient_accumulation_steps keeps the batch)"


@pytest.mark.parametrize("case", ["recipe sets it on", "recipe sets it off", "on after the retry"])
def test_otherwise_the_error_names_the_settings_that_lower_memory(tmp_path, capsys, monkeypatch, tiny_own_dir, case):
    train = {**TRAIN, "max_steps": 1}
    if case == "on after the retry":
        plan_with_room(monkeypatch)
        out_of_memory_at(monkeypatch, 1, 2)  # the first backward, then the first again after the retry
    else:
        train["activation_checkpointing"] = case == "recipe sets it on"
        out_of_memory_at(monkeypatch, 1)
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_own_dir, out=tmp_path / "run", lora={"r": 4}, train=train)
    code, out, err = run_cli(capsys, "train", recipe)
    assert code == 2
    on = case != "recipe sets it off"
    checkpointing = "train.activation_checkpointing_kwargs: {offload: true}" if on else "train.activation_checkpointing: true"
    assert err.splitlines()[-1] == (f"error: out of memory at step 1 (activation checkpointing {'on' if on else 'off'}); these settings "
                   f"lower memory: {LOWER}, {checkpointing}, model.load_in_4bit: true, or more GPUs sharding the model "
                   "(--num-processes N --accelerate-config recipes/accelerate/fsdp2.yaml)")
    assert "Traceback" not in err
    assert out.count("out of memory at step 1 with activation checkpointing off") == (case == "on after the retry")


@pytest.mark.parametrize("where", ["clipping", "optimizer step"])
def test_out_of_memory_after_the_backward_in_the_first_step_is_the_same_line(tmp_path, capsys, monkeypatch, tiny_own_dir,
                                                                            where):
    """Stand-in, as above: `Accelerator.clip_grad_norm_` or `AcceleratedOptimizer.step` (where AdamW allocates its
    state on the first step) raising torch.OutOfMemoryError. The first step ends in the same one line, no traceback;
    out of memory there came out as a bare traceback before."""
    from accelerate.optimizer import AcceleratedOptimizer

    owner, name = (Accelerator, "clip_grad_norm_") if where == "clipping" else (AcceleratedOptimizer, "step")

    def fails(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(owner, name, fails)
    train = {**TRAIN, "max_steps": 1, "activation_checkpointing": True}
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_own_dir, out=tmp_path / "run", lora={"r": 4}, train=train)
    code, out, err = run_cli(capsys, "train", recipe)
    assert code == 2
    assert err.splitlines()[-1] == ("error: out of memory at step 1 (activation checkpointing on); these settings lower memory: "
                                    f"{LOWER}, train.activation_checkpointing_kwargs: {{offload: true}}, "
                                    "model.load_in_4bit: true, or more GPUs sharding the model "
                                    "(--num-processes N --accelerate-config recipes/accelerate/fsdp2.yaml)")
    assert "Traceback" not in err
