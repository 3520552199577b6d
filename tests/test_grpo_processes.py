"""GRPO (`method: grpo`) in 2 processes (DDP over gloo on CPU, one `torch.distributed.run` launch for both runs).

(1) 3 steps in 2 processes x 4 completions log the same per-step loss, KL, entropy and rewards as 1 process x 4
completions with accumulation 2 (1e-5 relative), and save the same adapter (1e-5), which loads and scores as the
one-process one (logits within 2e-3: float32 rounding's reach here, `LOGITS_TOLERANCE`). Completions come from a seeded stand-in for TRL's generation (`_generate_single_turn`): TRL seeds
each process differently (`set_seed(seed, device_specific=True)`), so sampled completions differ with the process
count; the stand-in's depend only on the prompt's ids, which copy of the prompt in its group it is, and a fixed seed.

Why these two shapes train alike in TRL 1.16's design: `steps_per_generation` defaults to the accumulation, so both
generate once per optimizer step for the same `generation_batch_size` (8 = 4 x 2 processes x 1 = 4 x 1 x 2); the
`RepeatSampler` (seeded, the same in every process) yields the same 2 prompts x 4 copies per step, and accelerate
gives process p the p-th 4 of them, one whole group each (per-device batch a multiple of `num_generations`); rewards
are gathered over the generation batch before the per-group advantages, so they are the same; `dapo` divides each
micro-batch's token sum by (completion tokens of the whole generation batch, gathered) / processes x accumulation /
steps_per_generation, so the summed (1 process) or DDP-averaged (2 processes) gradient is the token sum over all 8
completions / their token count in both. A per-device batch that splits a group across processes, or
`steps_per_generation` set apart from the accumulation, makes the generation batches differ and is not compared.

Plain SGD (no momentum, no clipping): Adam's first step is about lr x sign(gradient), which turns 1e-7 rounding in a
near-zero gradient into a full-size difference. `beta` > 0, so the loss from step 2 on depends on the trained adapter
(at `num_iterations` 1 the policy term's value is -sum(advantage x length) / tokens, the same for any weights).

(2) A real 2-process run, TRL's own sampling: it completes, logs rewards at every step, and its adapter moved.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from erniekit_lite.cli import main
from helpers import run_logits, write_recipe

ROOT = Path(__file__).resolve().parents[1]
# The in-process run on one thread, as each launched worker (OMP_NUM_THREADS=1): steadier on a busy 2-core machine
pytestmark = pytest.mark.usefixtures("one_thread")
TOLERANCE = 1e-5
# The logits of the saved adapters: 3 SGD steps at learning rate 20 amplify rounding ~100x from weights to logits. One
# float32 rounding step (2^-24) on each initial adapter weight moves them by up to 6.1e-4 after the same training; 2
# processes differ from 1 by 2.2e-4 (benchmarks/results-grpo_rounding.txt, an AMD EPYC where 1e-5 failed)
LOGITS_TOLERANCE = 2e-3
COMPARED = ("loss", "reward", "reward_std", "completions/mean_length")  # as logged
PER_TOKEN = ("kl", "entropy")  # logged as the mean over micro-batches of each one's token mean: compared token-weighted

# The stand-in generator, a module the launched workers import and the test loads (zlib, not Python's hash: that is
# salted per process)
STAND_IN = '''
import zlib

import torch

SEED = 1234


def generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """Completions that depend only on the prompt's ids, its copy's index in its group and SEED: 2 to 7 ordinary
    tokens (ids 1000 to 19999) and the end-of-sequence token."""
    copies, completions = {}, []
    for ids in prompt_ids:
        k = copies[tuple(ids)] = copies.get(tuple(ids), -1) + 1
        g = torch.Generator().manual_seed(zlib.crc32(repr((SEED, list(ids), k % num_generations)).encode()))
        n = int(torch.randint(2, 8, (1,), generator=g))
        completions.append(torch.randint(1000, 20000, (n,), generator=g).tolist() + [self.eos_token_ids[0]])
    return completions, None
'''

REWARD = ("def low_ids(completion_ids, **kwargs):\n"
          "    return [sum(t < 8000 for t in ids) / len(ids) for ids in completion_ids]\n")

# Both 2-process runs in one launch: the stand-in's, then the real one with TRL's generation restored. The process
# group is torn down once, after the last run (a launched `train` tears it down as it ends, and a second run in the
# same processes would hang re-forming it; tests/test_step_weights.py)
DRIVER = """
import sys
import grpo_stand_in
from erniekit_lite import launch
from erniekit_lite.cli import main
from erniekit_lite.train.grpo_trainer import ErnieGRPOTrainer
end = launch.end_process_group
launch.end_process_group = lambda: None
trl_generate = ErnieGRPOTrainer._generate_single_turn
ErnieGRPOTrainer._generate_single_turn = grpo_stand_in.generate
stand_in = main(['train', sys.argv[1]])
ErnieGRPOTrainer._generate_single_turn = trl_generate
real = main(['train', sys.argv[2]])
end()
sys.exit(max(stand_in, real))
"""


def recipe_file(folder: Path, name: str, model_dir: Path, **train) -> Path:
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"What is {i} + {i + 3}?", "answer": f"#### {2 * i + 3}"}) + "\n"
                               for i in range(6)))
    (folder / "reward.py").write_text(REWARD)
    train = {"num_generations": 4, "per_device_train_batch_size": 4, "max_completion_length": 8, "beta": 0.5,
             "logging_steps": 1, "save_strategy": "no", "activation_checkpointing": False, "seed": 0, "max_steps": 3, **train}
    return write_recipe(folder / f"{name}.yaml", model_dir, method="grpo", lora={"r": 4, "alpha": 8, "dropout": 0.0},
                        data={"train": [str(prompts)], "max_length": 64}, out=folder / name, train=train,
                        rewards=[{"function": f"{folder}/reward.py:low_ids"}])


def compared_run(folder: Path, name: str, model_dir: Path, accumulation: int) -> Path:
    return recipe_file(folder, name, model_dir, gradient_accumulation_steps=accumulation, optim="sgd", learning_rate=20.0,
                       lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0, weight_decay=0.0)


def real_run(folder: Path, model_dir: Path) -> Path:
    return recipe_file(folder, "real", model_dir, max_steps=2, learning_rate=5e-2, temperature=1.0)


def step_logs(out: Path) -> list[dict]:
    return [h for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]


def relative(got: dict, expected: dict) -> float:
    assert got.keys() == expected.keys()
    num = sum(float((got[k].double() - expected[k].double()).pow(2).sum()) for k in expected)
    return (num / sum(float(v.double().pow(2).sum()) for v in expected.values())) ** 0.5


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, tiny_dense_dir) -> Path:
    """Both 2-process runs (the stand-in's with accumulation 1, the real one), one launch of torch's launcher."""
    tmp = tmp_path_factory.mktemp("grpo-ddp")
    (tmp / "grpo_stand_in.py").write_text(STAND_IN)
    (tmp / "driver.py").write_text(DRIVER)
    recipes = [str(compared_run(tmp, "two", tiny_dense_dir, 1)), str(real_run(tmp, tiny_dense_dir))]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "true", "HF_HOME": str(tmp / "hf"), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(tmp / "driver.py"), *recipes], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    print(f"2-process launch: {time.perf_counter() - start:.1f} s")
    return tmp


@pytest.mark.slow  # 65-75 s with the shared launch (~37 s, both runs) on 2 busy cores; the 1-process run 5-7 s
def test_two_processes_train_grpo_like_one_with_twice_the_accumulation(tmp_path, monkeypatch, tiny_dense_dir, two_processes):
    from erniekit_lite.train.grpo_trainer import ErnieGRPOTrainer

    (tmp_path / "grpo_stand_in.py").write_text(STAND_IN)
    spec = importlib.util.spec_from_file_location("grpo_stand_in", tmp_path / "grpo_stand_in.py")
    stand_in = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stand_in)
    seen = []

    def generate(self, prompt_ids, *args, **kwargs):
        seen.append(len(prompt_ids))
        return stand_in.generate(self, prompt_ids, *args, **kwargs)

    micro = []  # (completion tokens, KL, entropy) of each micro-batch of the one-process run
    compute_loss = ErnieGRPOTrainer._compute_loss

    def record(self, model, inputs):
        loss = compute_loss(self, model, inputs)
        micro.append((float(inputs["completion_mask"].sum()), *(self._metrics["train"][k][-1] for k in PER_TOKEN)))
        return loss

    monkeypatch.setattr(ErnieGRPOTrainer, "_generate_single_turn", generate)
    monkeypatch.setattr(ErnieGRPOTrainer, "_compute_loss", record)
    start = time.perf_counter()
    assert main(["train", str(compared_run(tmp_path, "one", tiny_dense_dir, 2))]) == 0
    print(f"1-process run: {time.perf_counter() - start:.1f} s")
    assert seen == [8, 8, 8]  # one generation of 2 prompts x 4 per optimizer step, as in 2 processes x 4

    one, two = tmp_path / "one", two_processes / "two"
    logs = {run: step_logs(out) for run, out in (("one", one), ("two", two))}
    assert [h["step"] for h in logs["two"]] == [1, 2, 3]
    assert json.loads((two / "train_results.json").read_text())["distributed"]["world_size"] == 2
    for got, expected in zip(logs["two"], logs["one"]):
        for key in COMPARED:
            assert got[key] == pytest.approx(expected[key], rel=TOLERANCE, abs=1e-8), (got["step"], key, got[key], expected[key])
    # TRL logs KL and entropy as the mean of its micro-batches' token means; weighted by their tokens, the one-process
    # values are the 2-process ones (a micro-batch of 1 process holds a random half of the 8 completions)
    assert len(micro) == 6
    for got, expected in zip(logs["two"], logs["one"]):
        halves = micro[2 * got["step"] - 2 : 2 * got["step"]]
        for i, key in enumerate(PER_TOKEN, start=1):
            assert expected[key] == pytest.approx(sum(m[i] for m in halves) / 2, rel=TOLERANCE)  # the logged mean
            weighted = sum(m[0] * m[i] for m in halves) / sum(m[0] for m in halves)
            assert got[key] == pytest.approx(weighted, rel=TOLERANCE, abs=1e-8), (got["step"], key, got[key], weighted)
    assert len({h["loss"] for h in logs["one"]}) == 3 and logs["one"][-1]["kl"] > 0  # the steps trained
    adapters = {run: load_file(str(out / "adapter_model.safetensors")) for run, out in (("one", one), ("two", two))}
    error = relative(adapters["two"], adapters["one"])
    print(f"adapter relative difference {error:.2e}; losses {[h['loss'] for h in logs['two']]} vs {[h['loss'] for h in logs['one']]}")
    assert error <= TOLERANCE
    assert any(float(v.abs().max()) > 0 for k, v in adapters["one"].items() if "lora_B" in k)

    logits = [run_logits(out) for out in (two, one)]
    assert float((logits[0] - logits[1]).norm() / logits[1].norm()) <= LOGITS_TOLERANCE


@pytest.mark.slow  # shares the launch above
def test_a_real_two_process_grpo_run_trains(two_processes):
    out = two_processes / "real"
    logs = step_logs(out)
    assert [h["step"] for h in logs] == [1, 2]
    assert all("reward" in h and "rewards/low_ids/mean" in h for h in logs)
    results = json.loads((out / "train_results.json").read_text())
    assert results["distributed"]["world_size"] == 2 and "reward" in results
    adapter = load_file(str(out / "adapter_model.safetensors"))
    assert any(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k)  # moved from its init (B = 0)
