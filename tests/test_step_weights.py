"""Every preference method computes the same optimizer step at any micro-batching, accumulation and process count
(train/trainer.py): each pair (KTO: each example) weighs 1/(pairs in the step), each chosen token of a per-token
term 1/(chosen tokens in the step).

One step of plain SGD (learning rate 1, no clipping, no decay) from a new LoRA adapter (B = 0) leaves B = -gradient,
so the saved adapters are the step's gradients. They must agree within 1e-5 relative across (a) 2 packed rows per
micro-batch, (b) 1 row with accumulation 2, (c) 2 processes x 1 row (DDP over gloo, every case in one launch) and
(d) the padded path (`data.packing: false`: this project's padded collators through the same trainer) over the same
pairs as one batch; TRL's own trainers are compared in the DPO, KTO, ORPO and reward-model tests. The two rows hold different numbers of pairs
(asserted), else a per-micro-batch mean would agree too. At the first step the policy equals the reference (B = 0),
so KTO's KL estimate is 0 in any micro-batching; the MoE cases run with `router_aux_loss_coef: 0`.

Then whole runs: for pt, dpo, kto (`apo_zero_unpaired`: no KL estimate), orpo, simpo and rm, 3 steps in 2 processes (1 row each) log the same per-step
losses as one process with accumulation 2 (1e-5 relative) and save the same adapter, which loads and scores as the
one-process one. SFT's own comparison is tests/test_distributed.py's. All 2-process runs share one launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_logits, write_recipe
from safetensors.torch import load_file

from erniekit_lite.cli import main

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"pt": "documents", "dpo": "pairs", "kto": "feedback", "orpo": "pairs", "simpo": "pairs", "rm": "pairs"}
STEPS = 3
MAX_LENGTH = {"pairs": 80, "kto": 96}  # each packs the data into 2 rows of 3 + 1 pairs, 2 + 6 examples
TOLERANCE = 1e-5
# One long pair and three short ones (KTO: each answer an example)
LONG = ("Tell me everything you know about the weather in spring, in detail please.",
        "Spring weather is mild: days grow longer, rain comes often, and the first flowers open in the warm sun.",
        "Spring is a season. It has weather, like the other seasons, and that is all there is to say about it really.")
SHORT = [("Hi?", "Hello.", "Go away."), ("2+2?", "4", "Five."), ("Name?", "Wenxin-Tiny.", "None.")]
CASES = {  # name: (model, method, train settings)
    "dpo-sigmoid": ("dense", "dpo", {"loss_type": "sigmoid"}),
    "dpo-ipo": ("dense", "dpo", {"loss_type": "ipo"}),
    "dpo-sigmoid+sft": ("dense", "dpo", {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}),
    "orpo": ("dense", "orpo", {}),
    "simpo": ("dense", "simpo", {}),
    "rm": ("dense", "rm", {}),
    "kto": ("dense", "kto", {}),
    "moe-dpo-sigmoid": ("moe", "dpo", {"loss_type": "sigmoid", "router_aux_loss_coef": 0.0}),
}
SHAPES = {  # (rows per micro-batch, accumulation, packing)
    "a": (2, 1, True),
    "b": (1, 2, True),
    "c": (1, 1, True),  # x 2 processes
    "d": (None, 1, False),  # every pair (or example) in one padded batch
}


def write_data(folder: Path) -> tuple[Path, Path]:
    pairs, feedback = folder / "pairs.jsonl", folder / "feedback.jsonl"
    with open(pairs, "w") as f:
        for q, good, bad in [LONG, *SHORT]:
            f.write(json.dumps({"src": [q], "tgt": [], "response": [[good], [bad]], "sort": [1, 0]}) + "\n")
    with open(feedback, "w") as f:
        for q, good, bad in [LONG, *SHORT]:
            f.write(json.dumps({"src": [q], "tgt": [good], "label": True}) + "\n")
            f.write(json.dumps({"src": [q], "tgt": [bad], "label": False}) + "\n")
    return pairs, feedback


def units_per_row(recipe: Path) -> list[int]:
    """Pairs (KTO: examples) in each packed row of the recipe's data, as the run packs them."""
    from erniekit_lite import recipe as recipes
    from erniekit_lite.data.prepare import prepare_feedback, prepare_pairs
    from erniekit_lite.model.load import load_tokenizer
    from erniekit_lite.model.source import tokenizer_path

    r = recipes.load(recipe)
    tokenizer = load_tokenizer(tokenizer_path(r.model.path))
    if r.method == "kto":
        return [len(row.desirable) for row in prepare_feedback(r.data, tokenizer, log=lambda *_: None).train.rows]
    return [len(row.seq_lengths) // 2 for row in prepare_pairs(r.data, tokenizer, log=lambda *_: None).train.rows]


def case_recipe(folder: Path, name: str, shape: str, models: dict, data: tuple[Path, Path]) -> Path:
    arch, method, train = CASES[name]
    rows, accumulation, packing = SHAPES[shape]
    total = 8 if method == "kto" else 4
    return write_recipe(
        folder / f"{name}-{shape}.yaml", models[arch], method=method, out=folder / f"{name}-{shape}",
        lora={"r": 4, "alpha": 8}, data={"train": [str(data[1] if method == "kto" else data[0])], "max_length": MAX_LENGTH["kto" if method == "kto" else "pairs"],
                                   "packing": packing},
        train={"optim": "sgd", "learning_rate": 1.0, "lr_scheduler_type": "constant", "warmup_steps": 0, "max_grad_norm": 0.0,
               "weight_decay": 0.0, "max_steps": 1, "seed": 0, "per_device_train_batch_size": rows or total,
               "gradient_accumulation_steps": accumulation, "activation_checkpointing": False, "save_strategy": "no",
               "logging_steps": 1, **train})


def write_run_data(folder: Path) -> dict[str, Path]:
    """Varied short records, enough for more than 2 x STEPS packed rows at max_length 64 (asserted): a step at an
    epoch's end would take fewer rows in one process than in two (accelerate fills the last batch from the start)."""
    import random

    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog model token answer question hello name tiny".split()

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choices(words, k=rng.randint(lo, hi)))

    files = {kind: folder / f"run-{kind}.jsonl" for kind in ("documents", "pairs", "feedback")}
    with open(files["documents"], "w") as f:
        for _ in range(24):
            f.write(json.dumps({"text": text(10, 40)}) + "\n")
    with open(files["pairs"], "w") as f:
        for _ in range(24):
            f.write(json.dumps({"src": [text(2, 6)], "tgt": [], "response": [[text(2, 12)], [text(2, 12)]], "sort": [1, 0]}) + "\n")
    # DPO's evaluation set: the first 10 pairs pack into 3 rows (3, 3, 4 pairs), so 2 processes' last eval batch is
    # evened out with a repeat of the first row, which the eval loss must leave out (train/trainer.py)
    (folder / "run-pairs-eval.jsonl").write_text("".join(files["pairs"].read_text().splitlines(keepends=True)[:10]))
    with open(files["feedback"], "w") as f:
        for i in range(36):
            f.write(json.dumps({"src": [text(2, 6)], "tgt": [text(2, 12)], "label": i % 3 != 0}) + "\n")
    return files


def run_recipe(folder: Path, method: str, accumulation: int, models: dict) -> Path:
    """STEPS steps of 1 row per micro-batch: in 2 processes with `accumulation` 1, in one with 2."""
    if not (folder / "run-pairs.jsonl").exists():
        write_run_data(folder)
    return write_recipe(
        folder / f"run-{method}-{accumulation}.yaml", models["dense"], method=method, out=folder / f"run-{method}-{accumulation}",
        lora={"r": 4, "alpha": 8}, data={"train": [str(folder / f"run-{RUNS[method]}.jsonl")], "max_length": 64, "packing": True,
                                   **({"eval": [str(folder / "run-pairs-eval.jsonl")]} if method == "dpo" else {})},
        train={"optim": "sgd", "learning_rate": 0.5, "lr_scheduler_type": "constant", "warmup_steps": 0, "max_grad_norm": 0.0,
               "weight_decay": 0.0, "max_steps": STEPS, "seed": 0, "per_device_train_batch_size": 1,
               "gradient_accumulation_steps": accumulation, "activation_checkpointing": False, "save_strategy": "no", "logging_steps": 1,
               # KTO's KL estimate is a mean over the micro-batch's twins, which TRL also averages over the processes: once
               # the policy moves it differs between the two setups (measured: losses 5e-5 apart at step 2), so the
               # whole-run comparison takes KTO's loss without it (the first-step test above covers `kto` itself)
               **({"loss_type": "apo_zero_unpaired"} if method == "kto" else {}),
               **({"eval_strategy": "steps", "eval_steps": STEPS, "per_device_eval_batch_size": 1} if method == "dpo" else {})})


def step(out: Path) -> dict[str, torch.Tensor]:
    """The adapter after the step: B is the negated gradient (A unchanged: its gradient is 0 while B is 0)."""
    return load_file(str(out / "adapter_model.safetensors"))


def relative(got: dict, expected: dict) -> float:
    assert got.keys() == expected.keys()
    num = sum(float((got[k].double() - expected[k].double()).pow(2).sum()) for k in expected)
    moved = sum(float(expected[k].double().pow(2).sum()) for k in expected if "lora_B" in k)
    return (num / moved) ** 0.5


@pytest.fixture(scope="module")
def models(tmp_path_factory, ernie_tokenizer_dir) -> dict:
    from erniekit_lite.tiny import write_tiny

    tmp = tmp_path_factory.mktemp("weights-models")
    return {"dense": Path(write_tiny(str(tmp / "dense"), "dense", str(ernie_tokenizer_dir), hidden_size=64, layers=2)),
            "moe": Path(write_tiny(str(tmp / "moe"), "moe", str(ernie_tokenizer_dir), hidden_size=64, layers=3))}


# `train` in every launched worker, once per recipe: the process group is torn down after the last run only (a
# launched `train` tears it down as it ends, and a second run in the same processes would then hang re-forming it)
DRIVER = """
import sys
from erniekit_lite import launch
from erniekit_lite.cli import main
end = launch.end_process_group
launch.end_process_group = lambda: None
codes = [main(['train', r]) for r in sys.argv[1:]]
end()
sys.exit(max(codes))
"""


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, models) -> Path:
    """Shape (c) of every case, in one 2-process launch (torch's launcher, gloo on CPU): the runs one after another."""
    tmp = tmp_path_factory.mktemp("weights-ddp")
    data = write_data(tmp)
    recipes = [str(case_recipe(tmp, name, "c", models, data)) for name in CASES]
    recipes += [str(run_recipe(tmp, method, 1, models)) for method in RUNS]
    driver = tmp / "driver.py"
    driver.write_text(DRIVER)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "true", "HF_HOME": str(tmp / "hf"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(driver), *recipes],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_one_step_is_the_same_at_any_batching(tmp_path, models, two_processes, name):
    data = write_data(tmp_path)
    adapters = {}
    for shape in ("a", "b", "d"):
        recipe = case_recipe(tmp_path, name, shape, models, data)
        if shape == "a":
            per_row = units_per_row(recipe)
            assert len(per_row) == 2 and per_row[0] != per_row[1], per_row  # else a per-micro-batch mean agrees too
        assert main(["train", str(recipe)]) == 0
        adapters[shape] = step(tmp_path / f"{name}-{shape}")
    adapters["c"] = step(two_processes / f"{name}-c")
    assert any(float(v.abs().max()) > 0 for k, v in adapters["d"].items() if "lora_B" in k)  # the step moved the adapter
    errors = {shape: relative(adapters[shape], adapters["d"]) for shape in "abc"}
    print(f"{name}: relative difference to the padded path {errors}")
    assert all(e <= TOLERANCE for e in errors.values()), errors


def step_losses(out: Path) -> list[float]:
    return [h["loss"] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]


def eval_losses(out: Path) -> list[float]:
    return [h["eval_loss"] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "eval_loss" in h]


@pytest.mark.slow
@pytest.mark.parametrize("method", list(RUNS))
def test_two_processes_train_like_one_with_twice_the_accumulation(tmp_path, models, two_processes, method):
    recipe = run_recipe(tmp_path, method, 2, models)
    if method != "pt":
        assert len(units_per_row(recipe)) > 2 * STEPS  # every step inside the first epoch
    assert main(["train", str(recipe)]) == 0
    one, two = tmp_path / f"run-{method}-2", two_processes / f"run-{method}-1"
    losses = step_losses(two)
    assert len(losses) == STEPS and losses == pytest.approx(step_losses(one), rel=TOLERANCE)
    assert losses[0] != losses[-1]  # the steps trained
    assert relative(step(two), step(one)) <= TOLERANCE
    if method == "dpo":  # the last eval batch of 2 processes repeats a row: left out, the eval loss is one process's
        assert eval_losses(two) and eval_losses(two) == pytest.approx(eval_losses(one), rel=TOLERANCE)
    if method == "rm":
        return  # a reward model scores with its head (tests/test_reward_model.py reloads it); its adapter compared above
    assert torch.allclose(run_logits(two), run_logits(one), rtol=TOLERANCE, atol=1e-6)


@pytest.mark.slow
def test_fsdp2_dpo_trains_like_one_process_with_twice_the_accumulation(tmp_path, models):
    """DPO (LoRA) sharded by FSDP2 over 2 gloo processes (fp32: the shipped config with mixed precision off): the same
    per-step losses and adapter as one process with accumulation 2."""
    from test_distributed import fsdp2_fp32, train_cli

    recipe = run_recipe(tmp_path, "dpo", 1, models)
    launched = train_cli(tmp_path, str(recipe), f"output.dir={tmp_path / 'fsdp2'}", "--num-processes", "2",
                         "--accelerate-config", str(fsdp2_fp32(tmp_path)), env={"OMP_NUM_THREADS": "1"})
    assert launched.returncode == 0, launched.stderr[-4000:]
    assert "distributed: FSDP2 over 2 processes (gloo)" in launched.stdout
    assert main(["train", str(run_recipe(tmp_path, "dpo", 2, models))]) == 0
    losses = step_losses(tmp_path / "fsdp2")
    assert len(losses) == STEPS and losses == pytest.approx(step_losses(tmp_path / "run-dpo-2"), rel=TOLERANCE)
    assert relative(step(tmp_path / "fsdp2"), step(tmp_path / "run-dpo-2")) <= TOLERANCE
