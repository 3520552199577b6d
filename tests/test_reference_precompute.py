"""Reference log-probs precomputed once (`train.precompute_ref_log_probs`, train/reference_logps.py): sharded over the
processes, gathered back in row order, cached on disk and reused by a second run or a `--resume`.

The stored values are read from the cache entry itself (`<ERNIEKIT_CACHE>/reference/<key>.npz`); each run line
"reference log-probs (train): N rows scored, a + b on 2 processes" is what rank 0 saw come back from each rank.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import TEST_EXTRA, need_module

from helpers import PAIRS, run_cli, write_recipe
from test_distributed import SHARDED, fp32_config, train_cli
from test_kto import FEEDBACK


def recipe(tmp_path: Path, model_dir: Path, lora: bool, **train) -> Path:
    """DPO with a precomputed reference. The eval split is what is checked: at max_length 40 the 8 demo pairs pack
    into 7 rows (an odd count: 3 + 4 rows on 2 processes) holding 1 or 2 pairs each. TRL's training step gathers
    per-pair rewards across processes, which needs equal pair counts, so the one step trains on 2 rows of one pair."""
    first = PAIRS.read_text().splitlines()[0]  # its chosen answer is cut at 40 tokens: one pair per row
    (tmp_path / "two.jsonl").write_text(f"{first}\n{first}\n")
    train = {"max_steps": 1, "per_device_train_batch_size": 1, "precompute_ref_log_probs": True, "activation_checkpointing": False,
             "eval_strategy": "no", "save_steps": 100, "logging_steps": 1, "seed": 0, **train}
    data = {"train": [str(tmp_path / "two.jsonl")], "eval": [str(PAIRS)], "max_length": 40}
    return write_recipe(tmp_path / "dpo.yaml", model_dir, method="dpo", data=data, train=train, output={"sample_prompts": []},
                        lora={"r": 4, "alpha": 8, "dropout": 0.0} if lora else None)


LINE = re.compile(r"reference log-probs \((train|eval)\): (\d+) rows (?:scored, ([\d +]+) on \d+ process(?:es)?; cached in|reused from) (\S+)")


def lines(stdout: str) -> dict[str, tuple[int, list[int] | None, Path]]:
    """Each split's line: (rows, rows scored by each process or None when reused, the cache entry)."""
    found = {split: (int(n), [int(k) for k in shards.split(" + ")] if shards else None, Path(path))
             for split, n, shards, path in LINE.findall(stdout)}
    assert len(LINE.findall(stdout)) == len(found) == 2, stdout  # one line per split, printed by rank 0 alone
    return found


def stored(path: Path) -> dict[str, list[list[float]]]:
    """The cache entry's values, per row."""
    with np.load(path) as z:
        return {name: [z[f"{name}.values"][a:b].tolist() for a, b in zip(z[f"{name}.bounds"], z[f"{name}.bounds"][1:])]
                for name in ("ref_chosen_logps", "ref_rejected_logps")}


def in_process(capsys, recipe_path: Path, cache: Path, *argv: str) -> str:
    """A 1-process run in this process, with its own reference cache; its stdout."""
    old = os.environ.get("ERNIEKIT_CACHE")
    os.environ["ERNIEKIT_CACHE"] = str(cache)
    try:
        code, out, err = run_cli(capsys, "train", recipe_path, *argv)
    finally:
        os.environ["ERNIEKIT_CACHE"] = old if old is not None else ""
        if old is None:
            del os.environ["ERNIEKIT_CACHE"]
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_own_dir):
    """The values a 1-process run stores, and its entries' names (keys), per split (the reference is the base model,
    LoRA or not)."""

    where = tmp_path_factory.mktemp("one-process")
    done = train_cli(where, str(recipe(where, tiny_own_dir, lora=False)), f"output.dir={where / 'out'}",
                     env={"ERNIEKIT_CACHE": str(where / "cache")})
    assert done.returncode == 0, done.stderr[-4000:]
    return {split: (stored(p), p.name) for split, (_, _, p) in lines(done.stdout).items()}


@pytest.mark.slow  # one launch of 2 processes (~15-40 s on 2 cores), and the 1-process run shared by the three
@pytest.mark.parametrize("strategy, lora", [("ddp", True), ("fsdp2", False), ("zero3", False)])
def test_two_processes_store_the_one_process_values(tmp_path, tiny_own_dir, one_process, strategy, lora):
    """2 gloo processes: each scores its contiguous shard of rows (3 + 4 of the 7 eval rows, none above ceil(7/2);
    1 + 1 train rows), and the stored lists, gathered back in row order, equal the 1-process values (1e-6). Full
    fine-tuning under FSDP2 scores on TRL's FSDP-sharded reference copy, whose forward is collective (the rank with
    3 rows runs a 4th, dropped); under ZeRO-3 on TRL's inference engine, which gathers each layer's parameters."""
    launch = ["--num-processes", "2"]
    if strategy != "ddp":
        if strategy == "zero3":
            need_module("deepspeed", TEST_EXTRA)
        launch += ["--accelerate-config", str(fp32_config(tmp_path, SHARDED[strategy][0]))]
    done = train_cli(tmp_path, str(recipe(tmp_path, tiny_own_dir, lora)), f"output.dir={tmp_path / 'out'}", *launch,
                     env={"ERNIEKIT_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-4000:]
    name = {"ddp": "DDP", **{k: v[1] for k, v in SHARDED.items()}}[strategy]
    assert f"distributed: {name} over 2 processes (gloo)" in done.stdout
    found = lines(done.stdout)
    for split, (n, shards, path) in found.items():
        assert sum(shards) == n and len(shards) == 2 and max(shards) <= math.ceil(n / 2)
        values, (expected_values, expected_name) = stored(path), one_process[split]
        for column, rows in values.items():
            expected = expected_values[column]
            assert [len(row) for row in rows] == [len(row) for row in expected]
            assert np.allclose(np.concatenate(rows), np.concatenate(expected), rtol=0, atol=1e-6)
        if not lora:  # the same model as the 1-process run: the same key, whatever the strategy
            assert path.name == expected_name, split
    assert found["eval"][1] == [3, 4] and found["train"][1] == [1, 1]


def kto_recipe(tmp_path: Path, model_dir: Path) -> Path:
    """KTO with LoRA and a precomputed reference: 4 training examples, the 26 demo examples as the eval split."""
    (tmp_path / "four.jsonl").write_text("\n".join(FEEDBACK.read_text().splitlines()[:4]) + "\n")
    train = {"max_steps": 1, "per_device_train_batch_size": 1, "precompute_ref_log_probs": True, "activation_checkpointing": False,
             "eval_strategy": "no", "save_steps": 100, "logging_steps": 1, "seed": 0, "beta": 0.1}
    data = {"train": [str(tmp_path / "four.jsonl")], "eval": [str(FEEDBACK)], "max_length": 40}
    return write_recipe(tmp_path / "kto.yaml", model_dir, method="kto", data=data, train=train, output={"sample_prompts": []},
                        lora={"r": 4, "alpha": 8, "dropout": 0.0})


@pytest.mark.slow  # two launches (1 and 2 processes), ~30-60 s on 2 cores
def test_kto_two_processes_store_the_one_process_values(tmp_path, tiny_own_dir):
    """KTO's reference pass, per example and per KL twin (`ref_logps`, `ref_KL_logps`): 2 DDP processes score contiguous
    shards, and the stored lists equal a 1-process run's under the same key (same rows, same seeded adapter): within
    1e-6 relative, as summed log-probs near -150 batched differently differ by a float32 ulp (measured: 1.2e-7)."""
    runs = {}
    for processes in (1, 2):
        where = tmp_path / str(processes)
        where.mkdir()
        done = train_cli(where, str(kto_recipe(where, tiny_own_dir)), f"output.dir={where / 'out'}",
                         *(["--num-processes", "2"] if processes == 2 else []), env={"ERNIEKIT_CACHE": str(where / "cache")})
        assert done.returncode == 0, done.stderr[-4000:]
        runs[processes] = lines(done.stdout)
    for split, (n, shards, path) in runs[2].items():
        one_n, one_shards, one_path = runs[1][split]
        assert n == one_n and one_shards == [n] and sum(shards) == n and max(shards) <= math.ceil(n / 2), split
        assert path.name == one_path.name, split
        with np.load(path) as z, np.load(one_path) as one:
            assert sorted(z.files) == sorted(one.files) and "ref_KL_logps.values" in z.files
            for name in z.files:
                if name.endswith(".bounds"):
                    assert z[name].tolist() == one[name].tolist(), name
                elif name.endswith(".values"):
                    assert np.allclose(z[name], one[name], rtol=1e-6, atol=1e-6), name


def test_a_second_run_and_a_resume_reuse_the_cached_reference_logps(tmp_path, capsys, tiny_own_dir):
    """One process: the first run scores every row of both splits and caches them (and removes an entry unused for
    31 days); a second run into a new output dir, and a `--resume` of the first, read the same entries back and score
    nothing (their lines say "reused"), and the entries stay as written. Rows hold 1 or 2 pairs: the eval entry keeps
    each row's own list. With `data.cache: false` nothing is read or written."""
    path, cache = recipe(tmp_path, tiny_own_dir, lora=True, save_steps=1), tmp_path / "cache"
    old = cache / "reference" / "0123456789abcdef.npz"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"an entry of an older version")
    os.utime(old, (old.stat().st_atime, old.stat().st_mtime - 31 * 86400))
    first = lines(in_process(capsys, path, cache))
    assert not old.exists()
    assert {split: (n, shards) for split, (n, shards, _) in first.items()} == {"train": (2, [2]), "eval": (7, [7])}
    values = stored(first["eval"][2])
    assert [len(row) for row in values["ref_chosen_logps"]] == [1, 1, 1, 1, 2, 1, 1]
    written = {split: p.read_bytes() for split, (_, _, p) in first.items()}

    again = lines(in_process(capsys, path, cache, f"output.dir={tmp_path / 'again'}"))
    resumed = lines(in_process(capsys, path, cache, "--resume", "train.max_steps=2"))
    for run in (again, resumed):
        assert run == {split: (n, None, p) for split, (n, _, p) in first.items()}  # reused, not scored
    assert {split: p.read_bytes() for split, (_, _, p) in first.items()} == written
    assert len(list((cache / "reference").glob("*.npz"))) == 2

    off = in_process(capsys, path, tmp_path / "no-cache", f"output.dir={tmp_path / 'off'}", "data.cache=false")
    assert "reference log-probs (eval): 7 rows scored, 7 on 1 process; not cached (data.cache: false)" in off
    assert not (tmp_path / "no-cache" / "reference").exists()
