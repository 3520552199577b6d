"""A training step that never waits for the host (issue 44): calls that read a device tensor on the host, counted
per optimizer step on CPU, for every method.

A dispatch mode counts the aten calls that make the host wait for the device on a GPU: `_local_scalar_dense` (a
tensor read as a Python number: `.item()`, `float()`, `bool()`, an `if` on a tensor), `nonzero`, `masked_select`,
boolean-mask indexing, `bincount`, `unique`, `repeat_interleave` without an output size. Runs of N and 2N optimizer
steps (accumulation 1, no logging step in between, no checkpoint) are counted and the difference divided by N, so
set-up and the end of training cancel out. Calls the collators and the dataloader make are left out: the batch is
still on the host there. Outside the dispatch, `Tensor.tolist` is counted the same way (on a GPU it reads the tensor
back; `.cpu()` and `.numpy()` are not seen); per-sample attention reading its sample lengths
(`attention.sample_lengths`) is counted separately: each time they were not handed over from the collator.

Every method but GRPO is the project's own step (train/trainer.py) and loss: nothing is read back between logging
steps, for SFT, pt, DPO, KTO, ORPO, SimPO and the reward model, full and LoRA, in 1 process and in each of 2.
"""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from erniekit_lite.cli import main
from erniekit_lite.model import attention
from erniekit_lite.train import callbacks
from helpers import IDENTITY, PAIRS, ROOT, write_recipe

SYNCING = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::bincount", "aten::_unique2",
           "aten::unique_consecutive", "aten::unique_dim", "aten::repeat_interleave"}
INDEXING = {"aten::index", "aten::index_put_", "aten::index_put"}
ON_THE_HOST = ("erniekit_lite/data/", "accelerate/data_loader.py", "torch/utils/data/")
LENGTHS_READ = "cu_seq_lens_q read back (attention.sample_lengths)"


class Syncs(TorchDispatchMode):
    """Sync-making calls, each as (call, file:line, function) of the nearest frame outside torch."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        boolean = name in INDEXING and any(t is not None and t.dtype == torch.bool for t in args[1])
        if name in SYNCING or boolean:
            stack = traceback.extract_stack()[:-1]
            if not any(host in f.filename for f in stack for host in ON_THE_HOST):
                frames = [f for f in stack if "/torch/" not in f.filename]
                where = frames[-1] if frames else stack[-1]
                self.calls[(name, f"{where.filename.split('site-packages/')[-1]}:{where.lineno}", where.name)] += 1
        return func(*args, **(kwargs or {}))


def syncs_per_step(tmp_path, monkeypatch, recipe_of, steps: int = 3) -> dict[tuple, float]:
    """{(call, file:line, function): calls per optimizer step} of the runs `recipe_of(path, out, steps)` writes."""
    counted, running, train, lengths = {}, [], callbacks.train, attention.sample_lengths

    def counting(trainer, out, resume=None):
        with Syncs() as syncs:
            running.append(syncs)
            result = train(trainer, out, resume)
        counted[out.name] = running.pop().calls
        return result

    def sample_lengths(cu):
        if running and getattr(cu, attention.LENGTHS, None) is None:  # not handed over: on a GPU, `.tolist()` of a device tensor
            running[-1].calls[(LENGTHS_READ, "", "")] += 1
        return lengths(cu)

    def tolist(tensor):
        stack = traceback.extract_stack()[:-1]
        if running and not any(host in f.filename for f in stack for host in ON_THE_HOST):
            where = stack[-1]
            running[-1].calls[("Tensor.tolist", f"{where.filename.split('site-packages/')[-1]}:{where.lineno}", where.name)] += 1
        return to_list(tensor)

    to_list = torch.Tensor.tolist
    monkeypatch.setattr(callbacks, "train", counting)
    monkeypatch.setattr(attention, "sample_lengths", sample_lengths)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    for n in (steps, 2 * steps):
        assert main(["train", str(recipe_of(tmp_path / f"r{n}.yaml", tmp_path / f"run{n}", n))]) == 0
    few, many = counted[f"run{steps}"], counted[f"run{2 * steps}"]
    return {k: (many[k] - few[k]) / steps for k in few.keys() | many.keys() if many[k] != few[k]}


DATA = {"pt": ROOT / "recipes" / "data" / "pt_demo.jsonl", "kto": ROOT / "recipes" / "data" / "identity_kto.jsonl"}
PAIR_METHODS = ("dpo", "orpo", "simpo", "rm")


def data_of(method: str) -> str:
    return str(DATA.get(method, PAIRS if method in PAIR_METHODS else IDENTITY))


@pytest.mark.parametrize("lora", [None, {"r": 4}], ids=["full", "lora"])
@pytest.mark.parametrize("method", ["sft", "pt", "dpo", "orpo", "simpo", "kto", "rm"])
def test_a_training_step_reads_nothing_back_from_the_device(tmp_path, monkeypatch, tiny_own_dir, method, lora):
    """Before (issue 44, counted the same way): 8 per step for SFT, 33.5 for DPO LoRA: the LM head's underflow
    branch, the NaN/inf filter, metrics' `.item()`, the divergence guard's `float(grad_norm)`, the boolean masks of
    trained positions, the step's pair counts, TRL's metrics; then (issue 76) TRL's preference losses still read 6-17
    per step (their metrics' `.item()`, `count > 0` tests, KTO's `nonzero` split by label). Now the collators count
    what the step needs on the CPU and every method's metrics stay on the device until a logging step."""

    def recipe_of(path, out, steps):
        return write_recipe(path, tiny_own_dir, method=method, lora=lora, out=out, data={"train": [data_of(method)]},
                            train={"max_steps": steps, "logging_steps": 1000, "save_strategy": "no", "learning_rate": 1e-3,
                                   "per_device_train_batch_size": 1})

    assert syncs_per_step(tmp_path, monkeypatch, recipe_of) == {}


@pytest.mark.parametrize("case", ["moe-full", "moe-lora", "qlora", "moe-qlora"])
def test_an_moe_or_qlora_sft_step_reads_nothing_back(tmp_path, monkeypatch, tiny_own_dir, tiny_moe_dir, case):
    """The expert load counts by scatter, not `bincount` and a mask; the split expert LoRA finds each expert's rows by
    a search over the sorted ids, not `bincount` (two reads per MoE layer and pass before); its 4-bit experts dequantize
    runs of rows fixed by the shapes, not each expert's rows (`.tolist()` of the offsets: 8 per step here before, issue 47)."""

    def recipe_of(path, out, steps):
        qlora = case.endswith("qlora")
        return write_recipe(path, tiny_own_dir if case == "qlora" else tiny_moe_dir, lora=None if case == "moe-full" else {"r": 4, "dropout": 0.0},
                            model={"dtype": "bfloat16", "load_in_4bit": True} if qlora else None, out=out,
                            train={"max_steps": steps, "logging_steps": 1000, "save_strategy": "no", "learning_rate": 1e-3,
                                   "per_device_train_batch_size": 1, "bf16": qlora})

    assert syncs_per_step(tmp_path, monkeypatch, recipe_of) == {}


def test_metrics_read_back_pooled_over_the_window():
    """A logging step reads the kept sums and counts back in one transfer: the means are pooled over the window's
    micro-batches (a micro-batch of 1 pair weighs a third of one of 3), a window's min and max are kept as such, and
    the window starts again after the read."""
    from types import SimpleNamespace

    from erniekit_lite.train.metrics import Metrics

    accelerator = SimpleNamespace(num_processes=1, device=torch.device("cpu"))
    metrics = Metrics()
    metrics.add("train", {"rewards/margins": (torch.tensor(0.3), 1), "num": (torch.tensor(123456789, dtype=torch.int64), 1)})
    metrics.add("train", {"rewards/margins": (torch.tensor(1.5), 3), "num": (0, 0)})
    metrics.add_extreme("train", "min_reward", torch.tensor([0.5, -2.0]), "min")
    metrics.add_extreme("train", "min_reward", torch.tensor([1.0]), "min")
    assert metrics.read("train", accelerator) == {"rewards/margins": pytest.approx(1.8 / 4), "num": 123456789.0, "min_reward": -2.0}
    assert metrics.read("train", accelerator) == {}


# In each launched process (LOCAL_RANK set): the same counting as `syncs_per_step`, over optimizer steps 2 and 3 of 4
# (from the start of step 2 to the start of step 4: the step's callbacks and the next batch's fetch included, no
# logging step in between), written to $COUNT_SYNCS/<rank>.json
IN_EACH_PROCESS = """
import os
if os.environ.get("LOCAL_RANK") is not None and os.environ.get("COUNT_SYNCS"):
    import collections, json, sys, traceback
    sys.path.insert(0, os.environ["COUNT_SYNCS_TESTS"])
    import torch
    from transformers import TrainerCallback
    from test_host_syncs import LENGTHS_READ, ON_THE_HOST, Syncs
    from erniekit_lite.model import attention
    from erniekit_lite.train import callbacks

    syncs, on, steps = Syncs(), [False], (1, 3)  # global steps done when counting starts and stops

    class Window(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == steps[0]:
                syncs.__enter__()
                on[0] = True
            elif state.global_step == steps[1] and on[0]:
                syncs.__exit__(None, None, None)
                on[0] = False

    to_list, lengths = torch.Tensor.tolist, attention.sample_lengths

    def tolist(tensor):
        stack = traceback.extract_stack()[:-1]
        if on[0] and not any(host in f.filename for f in stack for host in ON_THE_HOST):
            where = stack[-1]
            syncs.calls[("Tensor.tolist", f"{where.filename.split('site-packages/')[-1]}:{where.lineno}", where.name)] += 1
        return to_list(tensor)

    def sample_lengths(cu):
        if on[0] and getattr(cu, attention.LENGTHS, None) is None:
            syncs.calls[(LENGTHS_READ, "", "")] += 1
        return lengths(cu)

    torch.Tensor.tolist, attention.sample_lengths = tolist, sample_lengths
    train = callbacks.train

    def counting(trainer, out, resume=None):
        trainer.add_callback(Window())
        result = train(trainer, out, resume)
        per_step = {" | ".join(k): n / (steps[1] - steps[0]) for k, n in syncs.calls.items()}
        with open(os.path.join(os.environ["COUNT_SYNCS"], f"{out.name}-{os.environ['RANK']}.json"), "w") as f:
            json.dump(per_step, f)
        return result

    callbacks.train = counting
"""


CASES = {"sft-lora": ("sft", "lora"), "moe-full": ("sft", "full"), "dpo-lora": ("dpo", "lora"), "dpo-full": ("dpo", "full"),
         "kto-lora": ("kto", "lora"), "orpo-lora": ("orpo", "lora"), "simpo-full": ("simpo", "full"), "rm-lora": ("rm", "lora")}


@pytest.mark.slow  # one launch of 2 processes for every case, the runs one after another (tests/sequence_runs.py)
def test_two_processes_read_nothing_back(tmp_path, tiny_own_dir, tiny_moe_dir):
    """In each of 2 gloo processes (DDP), steps 2 and 3 read nothing back, for every method (the stop-on-signal flag
    is summed in host memory, DDP does not search for unused parameters, the step's unit counts are summed on the
    device, the metrics wait for a logging step)."""
    import json
    import os
    import subprocess
    import sys

    from test_distributed import GLOO_AT_EXIT, head_chunks_env, write_data

    counts = tmp_path / "counts"
    counts.mkdir()
    sft_data = write_data(tmp_path / "data.jsonl")
    argv = []
    for case, (method, kind) in CASES.items():
        data = data_of(method) if method != "sft" else str(sft_data)
        path = write_recipe(tmp_path / f"{case}.yaml", tiny_moe_dir if case == "moe-full" else tiny_own_dir, method=method,
                            lora={"r": 4, "alpha": 8, "dropout": 0.0} if kind == "lora" else None, out=tmp_path / case,
                            data={"train": [data], "max_length": 64 if method == "sft" else 128},
                            train={"max_steps": 4, "logging_steps": 1000, "save_strategy": "no", "learning_rate": 1e-3,
                                   "per_device_train_batch_size": 1, "activation_checkpointing": False, "seed": 0})
        argv += [str(path), str(tmp_path / case)]
    env = {**os.environ, **head_chunks_env(tmp_path / "hook", GLOO_AT_EXIT + IN_EACH_PROCESS), "CUDA_VISIBLE_DEVICES": "",
           "ACCELERATE_USE_CPU": "true", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1",
           "COUNT_SYNCS": str(counts), "COUNT_SYNCS_TESTS": str(Path(__file__).parent)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(Path(__file__).parent / "sequence_runs.py"), *argv], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    read = {(case, rank): json.loads((counts / f"{case}-{rank}.json").read_text()) for case in CASES for rank in (0, 1)}
    assert all(per_step == {} for per_step in read.values()), {k: v for k, v in read.items() if v}
