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

What remains is TRL's and is named here: its preference loss functions (DPO, KTO, ORPO, SimPO, the reward model) read
their metrics with `.item()`, test counts as Python bools and index by boolean masks, and KTO splits each batch by
label with `nonzero`; this project leaves them to TRL (train/trl_metrics.py).
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
# TRL 1.16's own reads, per micro-batch, in its preference loss functions (the module doc): the function, and how many
# of each kind. Its metrics' `.item()`, its `count > 0` tests and boolean-mask sums; KTO's split by label (`nonzero`)
TRL_LOSS = {"dpo": ("trl/trainer/dpo_trainer.py", "_compute_loss"), "kto": ("trl/trainer/kto_trainer.py", "_compute_loss"),
            "orpo": ("trl/experimental/orpo/orpo_trainer.py", "get_batch_loss_metrics"),
            "simpo": ("trl/experimental/cpo/cpo_trainer.py", "get_batch_loss_metrics"),
            "rm": ("trl/trainer/reward_trainer.py", "compute_loss")}
SCALAR, INDEX, NONZERO = "aten::_local_scalar_dense", "aten::index", "aten::nonzero"
TRL_READS = {"dpo": {SCALAR: 15, INDEX: 2}, "kto": {NONZERO: 2, INDEX: 2}, "orpo": {SCALAR: 11}, "simpo": {SCALAR: 9},
             "rm": {SCALAR: 6}}
KTO_READS = (10, 14)  # KTO's `.item()`s and `count > 0` tests: 4 of them only when the micro-batch holds that label


@pytest.mark.parametrize("lora", [None, {"r": 4}], ids=["full", "lora"])
@pytest.mark.parametrize("method", ["sft", "pt", "dpo", "orpo", "simpo", "kto", "rm"])
def test_a_training_step_reads_nothing_back_from_the_device(tmp_path, monkeypatch, tiny_own_dir, method, lora):
    """Before (issue 44, counted the same way): 8 per step for SFT, 33.5 for DPO LoRA: the LM head's underflow
    branch, the NaN/inf filter, metrics' `.item()`, the divergence guard's `float(grad_norm)`, the boolean masks of
    trained positions, the step's pair counts, TRL's metrics. Now the collators count what the step needs on the CPU
    and the project's metrics stay on the device until a logging step; the preference methods' reads are TRL's own,
    inside its loss function (`TRL_READS`)."""

    def recipe_of(path, out, steps):
        data = [str(DATA.get(method, PAIRS if method in ("dpo", "orpo", "simpo", "rm") else IDENTITY))]
        return write_recipe(path, tiny_own_dir, method=method, lora=lora, out=out, data={"train": data},
                            train={"max_steps": steps, "logging_steps": 1000, "save_strategy": "no", "learning_rate": 1e-3,
                                   "per_device_train_batch_size": 1})

    counts = syncs_per_step(tmp_path, monkeypatch, recipe_of)
    if method not in TRL_LOSS:
        assert counts == {}
        return
    where, function = TRL_LOSS[method]
    assert {(k[1].rsplit(":", 1)[0], k[2]) for k in counts} == {(where, function)}, f"calls outside TRL's loss: {counts}"
    kinds = collections.Counter()
    for (call, _, _), n in counts.items():
        kinds[call] += n
    if method == "kto":
        scalar = kinds.pop(SCALAR)
        assert KTO_READS[0] <= scalar <= KTO_READS[1], counts
    assert kinds == TRL_READS[method], counts


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


def test_metrics_kept_on_the_device_are_read_back_exactly_integers_as_integers():
    """A logging step reads the kept metrics back in one transfer per kind: TRL's token counter (an int64 tensor when
    its `.item()` is kept on the device) stays an integer; through float32 123456789 read 123456792. Only the read-back
    that the Trainer's `log` calls runs here, on TRL's metric dict."""
    from erniekit_lite.train.trl_metrics import read_back

    metrics = {"train": {"num_tokens": [torch.tensor(123456789)], "rewards/margins": [torch.tensor(0.25), 0.5]}}
    read_back(list(metrics.values()))
    assert metrics["train"] == {"num_tokens": [123456789], "rewards/margins": [0.25, 0.5]}
    assert type(metrics["train"]["num_tokens"][0]) is int


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
        with open(os.path.join(os.environ["COUNT_SYNCS"], os.environ["RANK"] + ".json"), "w") as f:
            json.dump(per_step, f)
        return result

    callbacks.train = counting
"""


@pytest.mark.slow  # one launch of 2 processes per case (~15 s on 2 idle cores)
@pytest.mark.parametrize("case", ["sft-lora", "moe-full", "dpo-lora"])
def test_two_processes_read_nothing_back_but_trls_own_metrics(tmp_path, tiny_own_dir, tiny_moe_dir, case):
    """In each of 2 gloo processes (DDP), steps read what one process reads: SFT nothing (the stop-on-signal flag is
    summed in host memory, DDP does not search for unused parameters), DPO only inside TRL's own loss function (its
    metrics, and gathering them: the ragged gather reads the processes' pair counts there)."""
    import json

    from test_distributed import GLOO_AT_EXIT, head_chunks_env, train_cli, write_data

    method, kind = {"sft-lora": ("sft", "lora"), "moe-full": ("sft", "full"), "dpo-lora": ("dpo", "lora")}[case]
    counts = tmp_path / "counts"
    counts.mkdir()
    data = PAIRS if method == "dpo" else write_data(tmp_path / "data.jsonl")
    path = write_recipe(tmp_path / "recipe.yaml", tiny_moe_dir if case == "moe-full" else tiny_own_dir, method=method,
                        lora={"r": 4, "alpha": 8, "dropout": 0.0} if kind == "lora" else None, out=tmp_path / "run",
                        data={"train": [str(data)], "max_length": 64 if method == "sft" else 128},
                        train={"max_steps": 4, "logging_steps": 1000, "save_strategy": "no", "learning_rate": 1e-3,
                               "per_device_train_batch_size": 1, "activation_checkpointing": False, "seed": 0})
    env = head_chunks_env(tmp_path / "hook", GLOO_AT_EXIT + IN_EACH_PROCESS)
    done = train_cli(tmp_path, str(path), "--num-processes", "2",
                     env={**env, "COUNT_SYNCS": str(counts), "COUNT_SYNCS_TESTS": str(Path(__file__).parent)})
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        per_step = json.loads((counts / f"{rank}.json").read_text())
        if method == "sft":
            assert per_step == {}, (rank, per_step)
            continue
        where, function = TRL_LOSS[method]
        trl = {k for k in per_step if k.split(" | ")[1].startswith(where) and k.endswith(function)}
        # TRL's metric gathers go through the ragged gather (train/ragged_gather.py), which reads the processes' counts
        gathers = {k for k in per_step if k.startswith("Tensor.tolist | ") and "ragged_gather.py:" in k and k.endswith(" | gather_ragged")}
        assert trl and gathers and set(per_step) == trl | gathers, (rank, per_step)
