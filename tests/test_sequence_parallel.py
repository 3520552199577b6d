"""`distributed.sequence_parallel: N`: each packed row's tokens split over N processes (docs/distributed.md, "One
sequence across GPUs").

Checked here on CPU over gloo, fp32: 2 processes sharing every row train the same weights as 1 process with the
same rows (SFT full and LoRA; DPO, KTO, ORPO, SimPO, PT and the reward model with LoRA; the MoE with its router aux loss, z-loss and
expert load), and 4 processes (2 data-parallel groups x 2, FSDP2 sharding every weight over the 4) the same as 1
process accumulating 2 rows; rows of 64 tokens cut at 32 put samples across the cut. One launch runs the methods one
after another (tests/sequence_runs.py), so torch starts once per launch. The cut itself (ids, positions, the scored positions' places) is checked exactly without processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from erniekit_lite.data.collate import PackedCollator
from erniekit_lite.data.sequence_shard import SequenceShard
from erniekit_lite.data.tokenize import IGNORE
from erniekit_lite.errors import UserError
from erniekit_lite.memory import kv_repeats, splits_of
from helpers import write_recipe
from test_distributed import fsdp2_fp32, write_data

ROOT = Path(__file__).resolve().parents[1]
RUNS = Path(__file__).with_name("sequence_runs.py")


def test_a_row_is_cut_on_token_boundaries_with_each_scored_position_in_its_place():
    rows = [{"input_ids": [11, 12, 13, 14, 15], "labels": [IGNORE, IGNORE, 13, 14, 15], "seq_lengths": [5]},
            {"input_ids": [21, 22, 23, 24], "labels": [IGNORE, 22, 23, 24], "seq_lengths": [4]}]
    whole = PackedCollator(16)(rows)
    cut = [SequenceShard(PackedCollator(16), 2, rank)(rows) for rank in (0, 1)]
    # 9 tokens -> 2 x 5: a pad sample of 1 token closes the row, its own causal block
    assert cut[0]["input_ids"].tolist() == [[11, 12, 13, 14, 15]] and cut[1]["input_ids"].tolist() == [[21, 22, 23, 24, 0]]
    assert cut[0]["position_ids"].tolist() == [[0, 1, 2, 3, 4]] and cut[1]["position_ids"].tolist() == [[0, 1, 2, 3, 0]]
    for part in cut:
        assert part["cu_seq_lens_q"].tolist() == [0, 5, 9, 10] and part["sample_lengths"] == [5, 4, 1]
        assert part["max_length_q"] == 5 and part["score_total"] == whole["score_positions"].numel() == 6
        assert part["sequence_tokens"] == 9 and torch.equal(part["labels"], whole["labels"])  # the counts stay whole
    # the scored positions: position p scores token p+1, so sample 1's 4th token (position 4) is scored on rank 0
    # and the first of sample 2 nowhere (its next token is a prompt's... here trained: position 5 predicts 22)
    assert whole["score_positions"].tolist() == [1, 2, 3, 5, 6, 7]
    assert cut[0]["score_positions"].tolist() == [1, 2, 3] and cut[0]["score_slots"].tolist() == [0, 1, 2]
    assert cut[1]["score_positions"].tolist() == [0, 1, 2] and cut[1]["score_slots"].tolist() == [3, 4, 5]
    targets = torch.cat([cut[0]["score_targets"], cut[1]["score_targets"]])
    assert torch.equal(targets, whole["score_targets"]) and targets.tolist() == [13, 14, 15, 22, 23, 24]


def test_which_splits_a_model_takes():
    assert splits_of(16, 2) == [2, 4, 8, 16]  # ERNIE 4.5 0.3B: key/value heads repeated from N=4 on
    assert kv_repeats(16, 2, 2) == 1 and kv_repeats(16, 2, 4) == 2
    assert splits_of(20, 4) == [2, 4, 5, 10]  # 21B-A3B (up to 16 processes a row)
    assert kv_repeats(20, 4, 3) is None


@pytest.mark.parametrize("change, says", [
    ({"method": "grpo", "rewards": [{"name": "length"}]}, "method grpo: not available"),
    ({"data__packing": False}, "set data.packing: true"),
    ({"distributed__sequence_parallel": 3}, "3 does not divide this model's 2 attention heads; it takes 2"),
    ({"model__attn_implementation": "eager"}, "model.attn_implementation eager cannot"),
    ({"distributed__sync": "local_sgd", "distributed__sync_every": 1}, "local_sgd does not"),
])
def test_what_a_split_row_cannot_run_is_one_line(tmp_path, tiny_own_dir, change, says):
    from erniekit_lite import recipe as recipes
    from erniekit_lite import run_plan
    from erniekit_lite.model.source import locate
    from erniekit_lite.trainer_args import training_args

    path = write_recipe(tmp_path / "r.yaml", tiny_own_dir, **{"distributed__sequence_parallel": 2, **change})
    recipe = recipes.load(str(path), [])
    args = training_args(recipe, tmp_path / "out")
    with pytest.raises(UserError, match="distributed.sequence_parallel") as error:
        run_plan.check_sequence_parallel(recipe, locate(str(tiny_own_dir), False).config, False, args)
    assert says in str(error.value)


def test_a_run_of_one_process_says_to_launch_n(tmp_path, tiny_own_dir, capsys):
    from erniekit_lite.cli import main

    path = write_recipe(tmp_path / "r.yaml", tiny_own_dir, distributed__sequence_parallel=2)
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "distributed.sequence_parallel: 2: this run has 1 process; launch a multiple of 2" in err and "Traceback" not in err
    assert main(["train", str(path), "--num-processes", "3"]) == 2
    assert "must divide the launch's 3 processes" in capsys.readouterr().err


def test_validate_plans_one_process_share_and_says_the_split(tmp_path, tiny_own_dir):
    from erniekit_lite import recipe as recipes
    from erniekit_lite.plan import plan

    def planned(*overrides: str) -> list[str]:
        lines: list[str] = []
        plan(recipes.load(str(write_recipe(tmp_path / "r.yaml", tiny_own_dir)), list(overrides)), log=lines.append)
        return lines

    whole, split = planned(), planned("distributed.sequence_parallel=2")
    tokens = [next(x for x in lines if x.startswith("memory per device")).split(" for ")[1].split(" tokens")[0]
              for lines in (whole, split)]
    assert tokens == ["1,024", "512"]  # 8 rows of max_length 128 (the default batch), half of each per process
    said = next(x for x in split if x.startswith("sequence parallel 2: "))
    assert "launch a multiple of 2 processes" in said and "(2 attention heads, 1 key/value) takes N = 2" in said
    assert any("the all-to-all copies attention keeps add" in x for x in split)
    assert not any(x.startswith("sequence parallel") for x in whole)


# --- the runs ------------------------------------------------------------------------------------------------------

def recipe(tmp_path: Path, name: str, model_dir: Path, method: str = "sft", lora: bool = True, **train) -> Path:
    data = {"train": [str(write_data(tmp_path / "data.jsonl"))], "max_length": 64} if method == "sft" else {"max_length": 128}
    demo = {"kto": "identity_kto.jsonl", "orpo": "identity_dpo.jsonl", "simpo": "identity_dpo.jsonl", "rm": "identity_dpo.jsonl",
            "pt": "pt_demo.jsonl"}
    if method in demo:
        data["train"] = [str(ROOT / "recipes" / "data" / demo[method])]
    return write_recipe(tmp_path / f"{name}.yaml", model_dir, method=method, data=data, output={"sample_prompts": []},
                        model={"dtype": "float32"}, lora={"r": 4, "alpha": 8, "dropout": 0.0} if lora else None,
                        # plain SGD, unclipped: a gradient off by a factor moves the weights by that factor (Adam's
                        # steps and clipping would hide a scale)
                        train={"optim": "sgd", "learning_rate": 0.05, "max_grad_norm": 0, "max_steps": 3, "per_device_train_batch_size": 2, "logging_steps": 1,
                               "save_steps": 100, "activation_checkpointing": False, "seed": 0, "bf16": False, **train})


def launch(tmp_path: Path, processes: int, runs: list[tuple[Path, Path]], config: Path | None = None) -> str:
    """`runs` (recipe, output dir) in one process, or in one launch of `processes` (DDP, or as `config` says)."""
    argv = [str(p) for run in runs for p in run]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HOME": str(tmp_path / "hf")}
    if processes == 1:
        command = [sys.executable, str(RUNS), *argv]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(ACCELERATE_USE_CPU="true", ERNIEKIT_SHARDING_ON_CPU="1")
        how = ["--config_file", str(config)] if config else ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"]
        command = [sys.executable, "-m", "erniekit_lite.launcher", "--num_processes", str(processes), *how,
                   "--num_machines", "1", "--main_process_port", str(port), str(RUNS), *argv]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-5000:])
    return done.stdout


def weights(out: Path) -> dict:
    name = "adapter_model.safetensors" if (out / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(out / name)


def history(out: Path, key: str) -> list[float]:
    return [h[key] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if key in h]


def assert_same_training(one: Path, split: Path, *logged: str):
    a, b = weights(one), weights(split)
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-3)) for k in a)
    assert worst < 1e-5, (split.name, worst)
    for key in ("loss", *logged):
        assert history(one, key), key
        # relative, or absolute for a difference of two near-equal sums (SimPO's margins of about 5e-4)
        assert history(split, key) == pytest.approx(history(one, key), rel=1e-5, abs=1e-7), (split.name, key)


@pytest.mark.slow  # one process, one launch of 2 and one of 4 (~70 s on 2 idle cores)
def test_processes_sharing_rows_train_what_one_process_trains(tmp_path, tiny_own_dir, tiny_moe_dir):
    cases = {
        "sft-full": recipe(tmp_path, "sft-full", tiny_own_dir, lora=False),
        "sft-lora": recipe(tmp_path, "sft-lora", tiny_own_dir),
        "dpo-lora": recipe(tmp_path, "dpo-lora", tiny_own_dir, method="dpo"),
        "kto-lora": recipe(tmp_path, "kto-lora", tiny_own_dir, method="kto"),  # and its KL twins, a second packed row
        "orpo-lora": recipe(tmp_path, "orpo-lora", tiny_own_dir, method="orpo"),
        "simpo-lora": recipe(tmp_path, "simpo-lora", tiny_own_dir, method="simpo"),
        "pt-lora": recipe(tmp_path, "pt-lora", tiny_own_dir, method="pt"),
        "rm-lora": recipe(tmp_path, "rm-lora", tiny_own_dir, method="rm"),  # each sequence's last token on either side
        "moe-full": recipe(tmp_path, "moe-full", tiny_moe_dir, lora=False, router_z_loss_coef=0.01),
    }
    split = {name: Path(str(path).replace(".yaml", "-split.yaml")) for name, path in cases.items()}
    for name, path in cases.items():
        split[name].write_text(path.read_text() + "distributed:\n  sequence_parallel: 2\n")
    # 2 data-parallel groups x 2 under FSDP2 (every weight sharded over the 4): one process takes each step's 2 rows
    # as 2 accumulated micro-batches of 1
    groups = recipe(tmp_path, "groups", tiny_own_dir, lora=False, per_device_train_batch_size=1, gradient_accumulation_steps=2)
    four = groups.with_name("groups-split.yaml")
    four.write_text(groups.read_text().replace("gradient_accumulation_steps: 2", "gradient_accumulation_steps: 1")
                    + "distributed:\n  sequence_parallel: 2\n")
    launch(tmp_path, 1, [(path, tmp_path / name) for name, path in cases.items()] + [(groups, tmp_path / "groups")])
    said = launch(tmp_path, 2, [(split[name], tmp_path / f"{name}-split") for name in cases])
    assert "sequence parallel: 2 processes share each row (2 processes = 1 data-parallel group x 2)" in said
    said = launch(tmp_path, 4, [(four, tmp_path / "groups-split")], fsdp2_fp32(tmp_path))
    assert "(4 processes = 2 data-parallel groups x 2)" in said and "FSDP2" in said
    for name in ("sft-full", "sft-lora"):
        assert_same_training(tmp_path / name, tmp_path / f"{name}-split", "mean_token_accuracy")
    assert_same_training(tmp_path / "dpo-lora", tmp_path / "dpo-lora-split", "rewards/margins", "logps/chosen")
    assert_same_training(tmp_path / "kto-lora", tmp_path / "kto-lora-split", "kl", "logps/chosen")
    assert_same_training(tmp_path / "orpo-lora", tmp_path / "orpo-lora-split", "rewards/margins", "log_odds_ratio")
    assert_same_training(tmp_path / "simpo-lora", tmp_path / "simpo-lora-split", "rewards/margins")
    assert_same_training(tmp_path / "pt-lora", tmp_path / "pt-lora-split")
    assert_same_training(tmp_path / "rm-lora", tmp_path / "rm-lora-split", "accuracy", "margin")
    assert_same_training(tmp_path / "moe-full", tmp_path / "moe-full-split", "aux_loss", "z_loss")
    load = [json.loads((tmp_path / name / "expert_load.json").read_text()) for name in ("moe-full", "moe-full-split")]
    assert load[0] == load[1]  # every routed token counted once, none of the padding
    assert_same_training(tmp_path / "groups", tmp_path / "groups-split")
    # the real tokens are the row's, counted once per group
    results = [json.loads((tmp_path / name / "train_results.json").read_text()) for name in ("sft-lora", "sft-lora-split")]
    assert results[0]["train_tokens"] == results[1]["train_tokens"]
    # and the rows too: samples/s over the run's time is the same samples (the Trainer counted each group's N times)
    samples = [r["train_samples_per_second"] * r["train_runtime"] for r in results]
    assert samples[1] == pytest.approx(samples[0], rel=2e-3), samples
