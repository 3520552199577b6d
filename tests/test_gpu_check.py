"""`benchmarks/gpu_check.py --smoke`: the GPU check's own code, run at tiny sizes on CPU, as the GPU machine will run
it at the released shapes (what needs CUDA, `packed_varlen` and peak memory, is reported as not available)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SHARED, needs_shared

ROOT = Path(__file__).resolve().parents[1]


def smoke_env(tmp_path) -> dict:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "ERNIEKIT_SHARED": str(SHARED), "HF_HOME": str(tmp_path / "hf")}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """What `--prepare-assets` writes for the GPU machine (both checks read it)."""
    tmp = tmp_path_factory.mktemp("gpu-assets")
    assets = tmp / "assets"
    prepared = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--prepare-assets", str(assets)],
                              capture_output=True, text=True, env=smoke_env(tmp), cwd=ROOT, timeout=300)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    return assets


@needs_shared
@pytest.mark.slow  # ~3 min on 2 cores: the sections the one GPU call (below) leaves out; six tiny trainings, an FSDP2 launch
def test_gpu_check_smoke_runs_the_sections_the_call_leaves_out(tmp_path, assets):
    env = smoke_env(tmp_path)
    assert {p.name for p in (assets / "tokenizer").iterdir()} >= {"tokenizer.model", "tokenizer_config.json"}
    assert (assets / "REVISION").read_text().strip()
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke", "--assets", str(assets), "--out", str(tmp_path),
                           "--only", "attention,qlora,moe,fsdp2,offload"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    text = (tmp_path / "results-gpu-smoke.txt").read_text()
    for heading in ("## 1. Packed attention vs each sample alone (bf16)", "## 4. 0.3B QLoRA",
                    "## 5.2. 21B-A3B LoRA SFT (r 32) cut to 2 layers", "## 5. 21B-A3B extrapolated to 28 layers",
                    "## 5x. Routed-expert adapters at the 21B-A3B shape, 2 layers", "## 6. FSDP2, 1 process",
                    "## 8. train.offload: parameters, 21B-A3B LoRA cut to 4 layers, capped below its plan"):
        assert heading in text, heading
    assert "## 2a." not in text and "## 9." not in text  # not asked for
    assert "Not available here: packed_varlen (CUDA only)" in text
    assert "torch.compile of a packed LoRA step with `packed_sdpa`" in text
    result = json.loads(text.strip().splitlines()[-1])
    names = {c["name"] for c in result["checks"]}
    assert {"attention 0.3b packed_sdpa", "attention 21b-a3b packed_sdpa", "attention 0.3b control",
            "attention 21b-a3b control", "fsdp2 1 process", "offload under a cap"} <= names
    assert all(c["ok"] for c in result["checks"]), [c for c in result["checks"] if not c["ok"]]
    packed = [a for a in result["attention"] if a["implementation"] == "packed_sdpa"]
    control = [a for a in result["attention"] if a["implementation"].startswith("control")]
    assert len(packed) == len(control) == 2
    assert all(a["max_logit_diff"] == 0 and a["rerouted_share"] == 0 for a in packed)  # per-sample sdpa on CPU: the same kernel
    assert all(a["max_logit_diff"] > 0.125 for a in control)  # attention across samples: the check sees it
    # 4, 5.2, 5.4, and 5x's merged and 4-bit-expert runs (bitsandbytes is a test dependency)
    assert len(result["training"]) == 5 and all(t["loss"] > 0 for t in result["training"])
    assert set(result["moe_expert_compute"]) == {"split", "merged", "split, 4-bit experts"}
    assert result["moe_extrapolated"]["layers"] == 28 and result["moe_extrapolated"]["plan_total_gib"] > 0
    assert len(result["seconds"]) == 5 and result["targets"] == []  # no GPU: no MFU or memory target measured
    offload = result["offload"]  # no CUDA: no cap or peak, the host bytes FSDP2's shards hold are the plan's
    assert offload["peak"] is None and offload["tokens_per_second"] > 0
    assert offload["host_bytes"] == pytest.approx(offload["host_bytes_planned"], rel=0.01)


@needs_shared
@pytest.mark.slow  # ~4 min on 2 cores: the weights written in a child beside eight tiny trainings (one profiled, one compiled, one TRL)
def test_the_one_gpu_call_smoke_answers_in_the_issues_order(tmp_path, assets):
    """benchmarks/gpu_call.py --smoke (issue 66's one call): the weights' writer started first, then 0.3B full and
    LoRA SFT eager and compiled, TRL, the 24 GB recipe on the written weights, the 2-layer MoE three ways, the
    profile and DPO, in that order, each part's seconds recorded (stand-in: tiny models on CPU, no GPU memory, so
    the full-depth memory line says there is no result)."""
    done = subprocess.run([sys.executable, "benchmarks/gpu_call.py", "--smoke", "--assets", str(assets), "--out", str(tmp_path)],
                          capture_output=True, text=True, env=smoke_env(tmp_path), cwd=ROOT, timeout=900)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    text = (tmp_path / "results-gpu-smoke-call.txt").read_text()
    headings = ["## Part 0. The 21B-A3B's weights", "## 2a. 0.3B full SFT", "## 2b. 0.3B LoRA SFT",
                "## 9. Compiled decoder layers (model.compile_layers) vs eager", "## 10. TRL SFTTrainer on the same card",
                "## Part 3. The 21B-A3B at all its layers: the weights", "## 1. 21B-A3B sft-qlora-24gb (smoke: tiny, 2 layers)",
                "## 5.2. 21B-A3B LoRA SFT (r 32) cut to 2 layers", "## 5x. Routed-expert adapters at the 21B-A3B shape, 2 layers",
                "## 7. Where a step's time goes (torch.profiler)", "## 3. 0.3B DPO LoRA"]
    at = [text.index(h) for h in headings]
    assert at == sorted(at), headings  # the issue's order
    assert "- MISSED memory 21B-A3B sft-qlora-24gb, all 28 layers: no result: no GPU memory to measure on CPU (--smoke)" in text
    result = json.loads(text.strip().splitlines()[-1])
    assert all(c["ok"] for c in result["checks"]), [c for c in result["checks"] if not c["ok"]]
    assert [s.rsplit(" ", 2)[0] for s in result["seconds"]] == ["1 sft eager and compiled", "2 trl", "3 full depth",
                                                                 "4 moe 2 layers", "5 profile", "5 dpo"]
    (qlora,) = result["recipes"]  # the 24 GB recipe on the weights the child wrote: loaded, timed steps
    assert (qlora["name"], qlora["stage"], qlora["exit"]) == ("sft-qlora-24gb", "done", 0) and qlora["tokens_per_second"] > 0
    assert {t["section"] for t in result["training"]} == {"2a", "2b", "5.2", "5.2m", "5.2q", "3"}
    # on CPU the speed targets are measured too (they need no GPU memory): named, whatever they say here
    assert {t["name"] for t in result["targets"]} == {
        "0.3B LoRA SFT over full SFT, real tokens/s", "21B-A3B 2 layers, split over merged expert LoRA, real tokens/s",
        "21B-A3B 2 layers, 4-bit over bf16 experts, real tokens/s", "memory 21B-A3B sft-qlora-24gb, all 28 layers"}
    (profiled,) = result["profile"]  # smoke: the LoRA run alone, one step recorded, aten ops but no kernels on CPU
    assert profiled["run"] == "0.3B LoRA SFT (r 32)" and profiled["aten_ops"] > 1000 and profiled["kernels"] == 0
    assert profiled["busy"] is None and profiled["wall_ms"] > 0
    by_section = {t["section"]: t for t in result["training"]}
    (compiled,) = result["compiled"]  # smoke: the 0.3B LoRA recipe alone, next to 2b's eager rate from the same call
    assert compiled["section"] == "2b" and compiled["stage"] == "done" and compiled["compiled_tokens_per_second"] > 0
    assert compiled["eager_tokens_per_second"] == by_section["2b"]["tokens_per_second"]["median"]
    trl = result["trl"]  # TRL's own packing (best-fit-decreasing, padding-free), full fine-tuning, next to 2a's rate
    assert trl["exit"] == 0 and trl["tokens_per_second"] > 0 and trl["padding_free"] is True and trl["steps_timed"] >= 1
    assert trl["ours_tokens_per_second"] == by_section["2a"]["tokens_per_second"]["median"]
    assert trl["gradient_checkpointing"] == by_section["2a"]["checkpointing"]


@needs_shared
@pytest.mark.slow  # ~80 s on 2 cores: three child processes (weights, two recipes) on a tiny 2-layer cut
def test_gpu_full_depth_smoke_runs_each_recipe_in_its_own_process(tmp_path, assets):
    """benchmarks/gpu_full_depth.py --smoke (a second call's, when the first leaves time): the weights written, then
    the bf16 LoRA and DPO QLoRA recipes each through the product path in a child process, what each child wrote read
    back (stand-in: a tiny 2-layer cut on CPU, no GPU peak, so no memory target). The 24 GB QLoRA recipe runs in the
    one call's test above."""
    done = subprocess.run([sys.executable, "benchmarks/gpu_full_depth.py", "--smoke", "--assets", str(assets), "--out", str(tmp_path),
                           "--only", "sft-lora,dpo-qlora"],
                          capture_output=True, text=True, env=smoke_env(tmp_path), cwd=ROOT, timeout=600)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    text = (tmp_path / "results-gpu-smoke-full-depth.txt").read_text()
    for heading in ("## 0. Random weights at the released config", "## 1. 21B-A3B sft-lora (smoke: tiny, 2 layers)",
                    "## 2. 21B-A3B dpo-qlora (smoke: tiny, 2 layers)"):
        assert heading in text, heading
    result = json.loads(text.strip().splitlines()[-1])
    assert [c["name"] for c in result["checks"]] == ["weights written", "trains 21B-A3B sft-lora", "trains 21B-A3B dpo-qlora"]
    assert all(c["ok"] for c in result["checks"]) and result["targets"] == []
    assert result["weights"]["bytes"] > result["weights"]["parameter_bytes"] > 0
    assert not Path(result["weights"]["dir"]).exists()  # the checkpoint is removed (41 GiB at full depth)
    runs = {r["name"]: r for r in result["recipes"]}
    for run in runs.values():  # 1 untimed step, then 2: every step reported, the load timed
        assert (run["stage"], run["steps"], run["exit"], run["layers"]) == ("done", 3, 0, 2)
        assert run["load_s"] > 0 and run["host_peak_gib"] > 0.1 and run["tokens_per_second"] > 0
        assert len(run["rates"]) == 3 and run["tokens_per_second_so_far"] == pytest.approx(run["tokens_per_second"])
    assert all(run["plan_allocated_gib"] > 0 for run in runs.values())  # each next to the plan for what ran


def test_a_child_past_its_cap_is_stopped_and_says_so(tmp_path):
    """What keeps one slow section from taking the others: the child is stopped at its cap, its stderr kept."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    script = tmp_path / "slow.py"
    script.write_text("import sys, time\nprint('loading', file=sys.stderr, flush=True)\ntime.sleep(60)\n")
    code, stderr = gpu_check.in_child(script, [], 2)
    assert code == "stopped at its cap (2 s)" and "loading" in stderr
    script.write_text("raise RuntimeError('CUDA out of memory')\n")
    code, stderr = gpu_check.in_child(script, [], 30)
    assert code == 1 and gpu_check.last_error(stderr) == "RuntimeError: CUDA out of memory"


def test_the_plan_compared_is_the_one_for_what_the_run_chose(tiny_dense_dir, tmp_path):
    """The first GPU run compared each peak with the plan for the recipe's defaults (checkpointing on, head
    recomputed) while `train` had turned checkpointing off and kept the head's chunks: peaks up to 5x "the plan".
    `run_choices` reads those choices from the lines `train` logs, and `planned` plans for them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    from erniekit_lite.run_plan import architecture, choose_checkpointing, head_keep_positions
    from erniekit_lite.recipe import from_dict
    from erniekit_lite.trainer_args import training_args

    recipe = from_dict({"model": {"path": str(tiny_dense_dir)}, "data": {"train": [str(ROOT / "recipes/data/identity.jsonl")],
                        "max_length": 1024}, "train": {"per_device_train_batch_size": 2}, "output": {"dir": str(tmp_path / "out")}})
    said: list[str] = []
    args = training_args(recipe, tmp_path / "out")
    arch = architecture(str(tiny_dense_dir), recipe)
    choose_checkpointing(recipe, args, arch, 10**15, said.append)  # a GPU with memory to spare (stand-in: no GPU here)
    assert head_keep_positions(recipe, args, arch, 10**15, said.append) > 0
    assert gpu_check.run_choices(said) == (False, True)
    assert gpu_check.run_choices([]) == (None, False)  # nothing said: the recipe's own setting held
    ran, defaults = gpu_check.planned(recipe, False, True), gpu_check.planned(recipe)
    assert (ran["checkpointing"], ran["head_kept"], defaults["checkpointing"], defaults["head_kept"]) == (False, True, True, False)
    # each choice moves the plan: every layer's activations kept, and the head's chunks kept instead of recomputed
    assert ran["plan_allocated_gib"] > gpu_check.planned(recipe, None, True)["plan_allocated_gib"]
    assert ran["plan_allocated_gib"] != gpu_check.planned(recipe, False, False)["plan_allocated_gib"]
