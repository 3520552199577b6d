"""GRPO (`method: grpo`) stopped after a checkpoint and resumed trains exactly as the uninterrupted run: the same
completions sampled at the same steps, every logged metric equal, the final adapter equal.

What a resume needs beyond transformers' checkpoint (weights, optimizer, scheduler, RNG), restored by
`ErnieGRPOTrainer` (grpo_trainer.py): epoch e's prompt order (TRL's sampler would start a resumed run at epoch 0's)
and, inside a generation cycle (`steps_per_generation` x `num_iterations` micro-steps on one generation), TRL's
buffered completions and its micro-step count (TRL would regenerate at the resume and then generate off the cycle).
Each case below fails without the fix it names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from erniekit_lite.train import checkpoints
from erniekit_lite.train.grpo_trainer import GENERATION_STATE, ErnieGRPOTrainer
from helpers import run_cli, write_recipe
from test_resume import logged_steps, stop_at

# In-process runs on one thread: steadier on a busy 2-core machine, and one fixed reduction order for the exact checks
pytestmark = pytest.mark.usefixtures("one_thread")

LOW_IDS = ("def low_ids(completions, completion_ids, **kwargs):\n"
           "    return [sum(t < 128 for t in ids) / len(ids) for ids in completion_ids]\n")
WALL_CLOCK = ("tokens_per_second", "step_time")  # the only logged values that are not a function of the run's state


def recipe_file(tmp_path: Path, name: str, model_dir: Path, **train) -> Path:
    """4 prompts x 4 completions, 2 prompts a step: an epoch is 2 optimizer steps, so a few steps cross epochs. LoRA
    dropout, so the restored RNG matters beyond sampling."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n" for i in range(4)))
    (tmp_path / "reward.py").write_text(LOW_IDS)  # moves under a random policy: groups carry advantage, the adapter moves
    train = {"num_generations": 4, "max_completion_length": 8, "per_device_train_batch_size": 8, "learning_rate": 5e-2,
             "beta": 0.0, "logging_steps": 1, "save_steps": 100, "activation_checkpointing": False, "seed": 0, **train}
    return write_recipe(tmp_path / f"{name}.yaml", model_dir, method="grpo", lora={"r": 4, "alpha": 8, "dropout": 0.1},
                        data={"train": [str(prompts)], "max_length": 64}, out=tmp_path / name, train=train,
                        rewards=[{"function": f"{tmp_path}/reward.py:low_ids"}, {"name": "exact_answer", "weight": 0.5}])


def logs(out: Path) -> list[dict]:
    """Per-step training logs of a finished run (a resumed run's include those restored from its checkpoint)."""
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [{k: v for k, v in h.items() if k not in WALL_CLOCK} for h in history if "loss" in h]


def record_generations(monkeypatch) -> list[tuple[int, list]]:
    """(optimizer steps done, completion ids) of every generation the trainer makes from now on."""
    seen = []
    original = ErnieGRPOTrainer._generate_and_score_completions

    def generate(self, inputs):
        out = original(self, inputs)
        seen.append((self.state.global_step, out["completion_ids"].tolist()))
        return out

    monkeypatch.setattr(ErnieGRPOTrainer, "_generate_and_score_completions", generate)
    return seen


# every-step: TRL's default cycle (one generation per optimizer step), stopped inside epoch 1 (steps 3-4), resumed with
#   --resume: fails without EpochRepeatSampler (the resumed run's new sampler draws epoch 0's prompt order for epoch 1
#   and epoch 1's for epoch 2).
# mid-cycle: steps_per_generation 2 x num_iterations 2 = one generation every 4 steps (steps 1, 5, 9; an epoch is one
#   cycle here), stopped at step 6 (steps 5-8 train on the completions generated at step 5), resumed with
#   train.resume_from_checkpoint=auto: fails without the saved generation state (TRL generates again at step 7 and
#   then every 4 steps from there, not at step 9).
# Tolerance: none. Every logged value (loss, grad_norm, learning_rate, rewards, reward_std, completion lengths, entropy,
# clip ratios, num_tokens, epoch) is compared with ==, the adapter with torch.equal: the resumed process restores the
# state bit for bit and then runs the same float32 CPU kernels, on one thread, in the same order. Only the wall-clock
# values (tokens_per_second, step_time) are left out. Each case takes ~6 s on a quiet 2-core machine (3 runs).
@pytest.mark.parametrize(("steps", "stop", "train", "how"), [
    (6, 3, {}, "--resume"),
    (10, 6, {"steps_per_generation": 2, "num_iterations": 2}, "train.resume_from_checkpoint=auto"),
], ids=["every-step", "mid-cycle"])
def test_resumed_grpo_run_equals_uninterrupted_run(tmp_path, capsys, monkeypatch, tiny_own_dir, steps, stop, train, how):
    generations = record_generations(monkeypatch)
    code, _, err = run_cli(capsys, "train", recipe_file(tmp_path, "reference", tiny_own_dir, max_steps=steps, **train))
    assert code == 0, err
    reference, reference_generations = logs(tmp_path / "reference"), list(generations)
    assert [h["step"] for h in reference] == list(range(1, steps + 1))

    path, out = recipe_file(tmp_path, "resumed", tiny_own_dir, max_steps=steps, **train), tmp_path / "resumed"
    with monkeypatch.context() as stopping:
        stop_at(stopping, stop)
        code, _, err = run_cli(capsys, "train", path)
    assert code == 143 and f"stopped at step {stop} of {steps}" in err, err
    checkpoint = out / f"checkpoint-{stop}"
    assert checkpoints.complete(out) == [checkpoint]
    saved = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_model.safetensors", "optimizer.pt", "rng_state.pth", GENERATION_STATE.format(0)} <= saved

    generations.clear()
    code, stdout, err = run_cli(capsys, "train", path, how)
    assert code == 0, err
    assert f"resuming from {checkpoint}" in stdout  # the GRPO checkpoint is found and loaded
    assert logged_steps(out) == list(range(1, steps + 1))  # after resuming: each step once
    # The same completions sampled at the same steps (and none at the resume itself inside a cycle)
    assert generations == [(done, ids) for done, ids in reference_generations if done >= stop] != []
    assert logs(out) == reference
    final, expected = load_file(out / "adapter_model.safetensors"), load_file(tmp_path / "reference" / "adapter_model.safetensors")
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in expected)
    assert any(t.abs().max() > 0 for k, t in final.items() if "lora_B" in k)  # trained: the adapter is not its init
