"""The memory estimate `validate` prints (erniekit_lite/memory.py): checked against measurements of tiny models on
CPU (benchmarks/memory_check.py measures; here on smaller shapes so the file runs in seconds), tied to the formula
in its docstring, and printed by validate, including QLoRA's note on a machine without a GPU.

Tolerances. Weights, gradients and optimizer states are byte counts and must match exactly. Activations are the
bytes autograd saves, which the formula counts tensor by tensor, so they must match within 5% (the slack is for
the few per-token bytes of router indices and checkpoint bookkeeping the formula rounds). The peak adds the
backward working set, which the formula fits from measurements (a quarter of a layer's activations, the LM-head
chunk's gradients): on the small shapes here the estimate must lie between 3% under and 10% over the measured peak.
That bound holds for these shapes, not in general: benchmarks/results-memory.txt measured -1.8% ... +5.6% on the
shapes the formula was fitted to, -10.0% ... -0.4% on held-out shapes (an underestimate of up to 10%) and
-2.1% ... +11.0% on the routed experts' merged, expert-rank and 4-bit paths.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import SHARED_HOW, missing
import torch

from erniekit_lite import memory
from erniekit_lite.cli import main
from helpers import run_cli, shared_data, write_recipe

ROOT = Path(__file__).resolve().parents[1]
IDENTITY = ROOT / "recipes" / "data" / "identity.jsonl"
GIB = memory.GIB


def _memory_check():
    spec = importlib.util.spec_from_file_location("memory_check", ROOT / "benchmarks" / "memory_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["memory_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


MC = _memory_check()
SMALL = dict(hidden=128, tokens=512, vocab=4096)
CASES = [
    MC.Case("dense full", layers=2, **SMALL),
    MC.Case("dense LoRA checkpointing", layers=2, lora=True, checkpointing=True, **SMALL),
    MC.Case("dense LoRA dropout, logits in chunks", layers=2, lora=True, lora_dropout=0.1, chunk_elements=2**17, trained=0.9, **SMALL),
    MC.Case("moe LoRA incl. routed experts", arch="moe", layers=3, lora=True, **SMALL),
    MC.Case("moe full checkpointing", arch="moe", layers=3, checkpointing=True, **SMALL),
    MC.Case("moe LoRA, experts merged (peft's path)", arch="moe", layers=3, lora=True, expert_compute="merged", **SMALL),
]
# 4-bit routed experts (split, their own rank) on a bf16 base under bf16 autocast, loaded by load_model; hidden 256: one
# quantization state per expert stack, as released. ~10 s: this CPU has no bf16 matmul units
QLORA = MC.Case("moe QLoRA, 4-bit experts, expert rank 4, checkpointing", arch="moe", layers=2, lora=True, expert_r=4,
                load_in_4bit=True, precision="bf16 autocast", checkpointing=True, **{**SMALL, "hidden": 256})


@pytest.mark.parametrize("case", CASES + [pytest.param(QLORA, marks=pytest.mark.slow)], ids=[c.name for c in CASES + [QLORA]])
def test_estimate_matches_measured_memory_of_tiny_models(case, one_thread):
    result = MC.measure(case)
    est, got = result["estimate"], result["measured"]
    for key in ("weights", "gradients", "optimizer"):
        assert est[key] == got[key], (key, est[key], got[key])
    saved_est, saved_got = est["activations"] + est["logits"], got["activations"] + got["logits"]
    assert abs(saved_est / saved_got - 1) <= 0.05, (saved_est, saved_got)
    assert 0.97 <= est["peak"] / got["peak"] <= 1.10, (est["peak"], got["peak"])


def _meta(config, lora=None):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if lora is not None:
        from erniekit_lite.model.lora import apply_lora

        model = apply_lora(model, lora)
    return model


def test_per_layer_formula_is_the_documented_one():
    """0.3B full fine-tuning in fp32, sdpa, no checkpointing, worked by hand from the docstring."""
    from erniekit_lite.tiny import tiny_config

    config = tiny_config("dense", 103424, released_shape=True)
    shape = memory.Shape.from_config(config)
    params = memory.params_of(_meta(config))
    h, d, heads, kv, inter, r = 1024, 128, 16, 2, 3072, 4
    norms = 2 * (4 * h + 4 + r * h)
    attention = 8 * d + r * (heads + 2 * kv) * d + r * heads * d + 4 * heads
    mlp = 3 * r * inter
    inputs = r * h + r * heads * d + r * h + r * inter  # q/k/v, o_proj, gate/up, down_proj
    run = memory.Run(tokens=8192, scored=8192, attention="sdpa", checkpointing=False)
    assert memory._one_layer(shape, params, run, moe=False, grad_in=True) == norms + attention + mlp + inputs == 101448


def test_qlora_counts_4bit_linears_and_routed_experts():
    """bitsandbytes quantizes nn.Linear; model/expert_4bit.py the MoE's fused routed experts, in the same NF4 layout
    with one quantization state per fused parameter (its code tables) and one absmax offset per expert."""
    from erniekit_lite.recipe import LoraSection
    from erniekit_lite.tiny import tiny_config

    config = tiny_config("moe", 1024, hidden_size=64, layers=3)
    params = memory.params_of(_meta(config, LoraSection(r=4)))
    experts = sum(p.numel() for n, p in _meta(config).named_parameters() if ".experts." in n)
    embeddings = 1024 * 64
    assert params.other >= experts + embeddings  # routed experts and embeddings: not nn.Linear
    assert params.experts_frozen == experts and params.expert_stacks == 2 * 2 and params.experts_per_stack == config.moe_num_experts
    linears = 3 * (64 * 64 * 2 + 64 * 32 * 2)  # q, o (64x64) and k, v (64x32) in every layer
    linears += 3 * 64 * 64 + 2 * 3 * 64 * 64  # dense layer-0 MLP (32 x 2 shared x 1 kv head wide, as released), 2 layers of shared experts (2 x 32 wide)
    assert params.linear == linears
    shape = memory.Shape.from_config(config)
    run = memory.Run(tokens=1024, scored=1024, dtype_bytes=2, autocast=True, load_in_4bit=True)
    est = memory.estimate(shape, params, run)
    lora = params.trainable * 2  # TRL casts QLoRA adapters to bf16
    assert params.linear_modules == 3 * 4 + 3 + 2 * 3  # attention, the dense MLP, the shared experts' projections
    linears_4bit = int(params.linear * memory.NF4_BYTES + params.fp32 * 4 + params.other * 2 + lora) + params.linear_modules * memory.NF4_MODULE_BYTES
    experts_4bit = int(experts * (memory.NF4_BYTES - 2)) + 4 * (memory.NF4_MODULE_BYTES - 4 + 4 * config.moe_num_experts)
    assert est.weights == linears_4bit + experts_4bit
    assert est.gradients == lora and est.optimizer == 2 * lora
    assert f"+ {experts:,} (fused routed experts)" in est.four_bit


def test_powersgd_and_local_sgd_are_counted_in_the_plan():
    """0.3B full fine-tuning: PowerSGD keeps an error-feedback buffer of every gradient's size for the whole run and
    clones the one bucket each step; local SGD flattens the trained parameters (and, with train.ema, the fp32 EMA) at
    each averaging. Both were left out of the plan."""
    import dataclasses

    from erniekit_lite.tiny import tiny_config

    config = tiny_config("dense", 103424, released_shape=True)
    shape, params = memory.Shape.from_config(config), memory.params_of(_meta(config))
    run = memory.Run(tokens=8192, scored=8192, autocast=True)
    plain = memory.estimate(shape, params, run)
    powersgd = memory.estimate(shape, params, dataclasses.replace(run, sync="powersgd"))
    grads = params.trainable * 4
    assert powersgd.sync == powersgd.sync_peak == grads == plain.gradients
    assert powersgd.static == plain.static + grads
    assert powersgd.total - plain.total >= grads  # and the clone when it outgrows the forward's memory
    local = memory.estimate(shape, params, dataclasses.replace(run, sync="local_sgd", dtype_bytes=2))
    assert (local.sync, local.sync_peak) == (0, params.trainable * 2)
    with_ema = memory.estimate(shape, params, dataclasses.replace(run, sync="local_sgd", dtype_bytes=2, ema=True))
    assert with_ema.sync_peak == params.trainable * 4  # the fp32 EMA agreed at a save
    assert memory.sync_memory(powersgd, dataclasses.replace(run, sync="powersgd")) == (
        f"memory: {memory.size(grads)} of error feedback kept (every gradient's size) and the gradient bucket cloned each "
        f"step, {memory.size(grads)}, counted in the plan below")


def test_smallest_gpu():
    assert memory.smallest_gpu(3 * GIB) == 24
    assert memory.smallest_gpu(24 * GIB) == 24
    assert memory.smallest_gpu(24 * GIB + 1) == 48
    assert memory.smallest_gpu(100 * GIB) == 141
    assert memory.smallest_gpu(142 * GIB) is None


def _recipe(tmp_path: Path, model_dir: Path, lora: bool = True, **model) -> Path:
    return write_recipe(tmp_path / "recipe.yaml", model_dir, model=model, lora={"r": 4} if lora else None,
                        train={"max_steps": 1, "per_device_train_batch_size": 2})


def test_validate_prints_memory_and_returns_it(tmp_path, capsys, tiny_own_dir):
    from erniekit_lite import recipe as recipes
    from erniekit_lite.plan import plan

    lines = []
    info = plan(recipes.load(_recipe(tmp_path, tiny_own_dir), ["train.bf16=false"]), log=lines.append)
    text = "\n".join(lines)
    assert "memory per device (estimate): " in text and "256 tokens per micro-batch" in text  # 2 rows of 128
    assert "activation checkpointing on" in text  # TRL's default
    assert "fits a 24 GB GPU" in text and info["fits_gpu_gb"] == 24
    assert 0.5 <= info["memory_gb"] < 2  # a tiny model: the overhead term (CUDA context) dominates
    assert "QLoRA" not in text
    assert "LM head trains" not in text and "memory_gb_head_kept" not in info  # LoRA: the head is frozen


def test_validate_of_a_full_fine_tune_gives_both_lm_head_plans(tmp_path, tiny_own_dir):
    """Full fine-tuning trains the head: validate's estimate recomputes its chunks and names what keeping them
    (what `train` does when the device has room) needs."""
    from erniekit_lite import recipe as recipes
    from erniekit_lite.plan import plan

    lines = []
    info = plan(recipes.load(_recipe(tmp_path, tiny_own_dir, lora=False), ["train.bf16=false"]), log=lines.append)
    said = [line for line in lines if "LM head trains:" in line]
    assert len(said) == 1 and f"needs {info['memory_gb_head_kept']:.1f} GiB" in said[0]
    # and the run plan `train` would resolve on this machine (the tiny model fits the host: its chunks are kept)
    ran = lines[lines.index(next(line for line in lines if line.startswith("run plan on this machine (sft)"))) + 1]
    assert "LM head trains, chunks kept for backward (up to 256 positions)" in ran
    assert info["memory_gb_head_kept"] >= info["memory_gb"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="has a GPU")
def test_validate_plans_qlora_without_a_gpu_note(tmp_path, capsys, tiny_moe_dir):
    """QLoRA runs wherever bitsandbytes does, CPUs included: no 'needs a GPU' note, the 4-bit plan printed."""
    code = main(["validate", str(_recipe(tmp_path, tiny_moe_dir, dtype="bfloat16", load_in_4bit=True)), "train.bf16=true"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "needs a CUDA GPU" not in out
    assert "bf16 autocast, 4-bit base" in out
    assert "4-bit NF4: " in out and " (fused routed experts); bf16: " in out
    assert not (tmp_path / "out").exists()


def test_released_03b_lora_recipe_fits_a_24gb_gpu(capsys):
    from conftest import ERNIE_TOKENIZER_DIR

    if not ERNIE_TOKENIZER_DIR.is_dir():
        missing("the shared reference files", SHARED_HOW)
    recipe = ROOT / "recipes" / "ernie-4.5-0.3b" / "sft-lora.yaml"
    code = main(["validate", str(recipe), f"model.path={ERNIE_TOKENIZER_DIR}", *shared_data(recipe)])
    out, err = capsys.readouterr()
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("memory per device"))
    assert "8,192 tokens per micro-batch on a CUDA GPU (bf16 autocast, activation checkpointing on); fits a 24 GB GPU" in line
    assert "needs a CUDA GPU" not in out  # bf16 autocast runs on CPU too


def _offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_a_model_folder_with_only_config_json_is_planned_offline(tmp_path, capsys, monkeypatch, ernie_tokenizer_dir):
    """A release's config.json copied alone into a folder outside the repo, with HF_HUB_OFFLINE set: `validate` plans
    the memory from the config, says in one line that the data was not read and what the plan assumes, and plans
    what it plans with the tokenizer beside the config (the real 0.3B config; the fixture's re-saved real tokenizer
    stands in for the release's tokenizer files)."""
    import shutil

    from conftest import ERNIE_TOKENIZER_DIR

    _offline(monkeypatch)
    only, full = tmp_path / "config-only", tmp_path / "with-tokenizer"
    only.mkdir()
    shutil.copy(ERNIE_TOKENIZER_DIR / "config.json", only)
    shutil.copytree(ernie_tokenizer_dir, full)
    shutil.copy(ERNIE_TOKENIZER_DIR / "config.json", full)
    recipe = write_recipe(tmp_path / "recipe.yaml", only, lora={"r": 8}, data={"max_length": 1024},
                          train={"per_device_train_batch_size": 1})

    code, out, err = run_cli(capsys, "validate", recipe)
    assert code == 0, err
    lines = out.splitlines()
    said = [line for line in lines if line.startswith("data: ")]
    assert said == [f"data: not read (no tokenizer at {only}); the memory plan assumes every row full, data.max_length "
                    "1,024 tokens per sequence, as packed rows nearly are; no token statistics or step count"]
    assert lines[-1] == f"{recipe}: valid (the data was not read: no tokenizer)"
    assert not any(line.startswith(("tokens per sequence", "batches: ")) for line in lines)
    planned = [line for line in lines if line.startswith(("memory per device", "  = "))]
    assert len(planned) == 2 and "1,024 tokens per micro-batch" in planned[0]

    code, out, err = run_cli(capsys, "validate", recipe, f"model.path={full}")
    assert code == 0, err
    assert "data: not read" not in out and "tokens per sequence: mean" in out
    assert [line for line in out.splitlines() if line.startswith(("memory per device", "  = "))] == planned


def test_a_model_folder_without_config_json_says_what_each_command_needs(tmp_path, capsys, monkeypatch):
    """An empty folder: one whole line naming config.json for the plan, the tokenizer's files for the data and the
    weights for training (before: transformers' tokenizer error, cut after "from one of: ")."""
    _offline(monkeypatch)
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = run_cli(capsys, "validate", write_recipe(tmp_path / "recipe.yaml", empty))
    assert code == 2
    assert [line for line in err.splitlines() if not line.startswith((" ", "/"))] == [  # no Python warnings
        f"error: model.path: {empty}: no config.json in this folder; `validate` needs only config.json for its memory "
        "plan, the tokenizer (tokenizer.model, tokenizer_config.json, added_tokens.json and special_tokens_map.json as "
        "released, or a tokenizer.json) to read the data, and `train` the weights (*.safetensors) too"
    ]


@pytest.mark.parametrize("override,gpu_precision,cpu_precision", [
    (None, "bf16 autocast", "none"),  # the quick start's case: no train.bf16, fp32 weights
    ("train.bf16=true", "bf16 autocast", "bf16 autocast"),
    ("train.bf16=false", "fp32", "none"),
])
def test_validate_names_the_device_its_plan_is_for(tmp_path, tiny_own_dir, override, gpu_precision, cpu_precision):
    """The memory line is the CUDA GPU's run (the GPU default is bf16 autocast); without a GPU the next line says
    what `train` runs on this machine's CPU, in the words of its `distributed: ... mixed precision:` line
    (tests/test_bf16.py checks that line after training: none for fp32, bf16 autocast with train.bf16)."""
    from erniekit_lite import recipe as recipes
    from erniekit_lite.plan import plan

    lines = []
    plan(recipes.load(_recipe(tmp_path, tiny_own_dir), [override] if override else []), log=lines.append)
    memory_line = next(x for x in lines if x.startswith("memory per device"))
    here = [x for x in lines if "this machine has no CUDA GPU" in x]
    assert " tokens per micro-batch on a CUDA GPU (" in memory_line
    if torch.cuda.is_available():
        assert here == []
    else:
        assert f"on a CUDA GPU ({gpu_precision}, " in memory_line
        assert here == [f"  this machine has no CUDA GPU: `train` here runs on its CPU with mixed precision: {cpu_precision} "
                        "(the plan above is for the GPU run)"]


def test_sharded_estimate_divides_the_states():
    est = memory.Estimate(weights=80 * GIB, gradients=80 * GIB, optimizer=160 * GIB, activations=GIB, logits=0, transient=GIB, reference=0, overhead=0)
    params = memory.Params(linear=0, fp32=0, other=0, trainable=0, trained=frozenset(), layer_params_max=0)
    run = memory.Run(tokens=8192, scored=8192)
    allocated = 320 * GIB // 8 + 2 * GIB
    assert memory.sharded_total(est, params, run, 8) == allocated + memory.CONTEXT_BYTES + int(memory.FRAGMENTATION * allocated)


def _memory_table() -> dict[str, float]:
    """The memory table of docs/memory.md ("The shipped recipes") as {recipe file: GiB}."""
    import re

    text = (ROOT / "docs" / "memory.md").read_text(encoding="utf-8")
    table = text[text.index("| recipe | estimate | fits |"):].split("\n\n")[0]
    figures = {}
    for row in table.splitlines()[2:]:
        model, files, values = re.match(r"\| (\S+) (.+?) \| ([\d./ ]+) GiB \|", row).groups()
        names = re.findall(r"`([^`]+)`", files)
        for name, value in zip(names, values.split(" / ")):
            folder = {"0.3B": "ernie-4.5-0.3b", "21B-A3B": "ernie-4.5-21b-a3b", "21B-A3B-Thinking": "ernie-4.5-21b-a3b-thinking"}[model]
            figures[f"{folder}/{name}"] = float(value)
    return figures


@pytest.mark.slow  # ~40 s: validate plans eleven released recipes (their data prepared, the models built on meta)
def test_memory_table_is_what_validate_prints(tmp_path):
    """Each figure of the memory table in docs/memory.md equals `validate`'s estimate for that shipped recipe (to
    0.1 GiB), with the released configs (../shared) and the real tokenizer."""
    import shutil

    from conftest import ERNIE_TOKENIZER_DIR, SHARED

    from erniekit_lite import recipe as recipes
    from erniekit_lite.plan import plan

    moe_config = SHARED / "ernie45" / "ernie-4.5-21b-a3b-pt" / "config.json"
    if not ERNIE_TOKENIZER_DIR.is_dir() or not moe_config.is_file():
        missing("the shared reference files", SHARED_HOW)
    moe = tmp_path / "21b"  # the released MoE config with the (shared) ERNIE 4.5 tokenizer: planning reads no weights
    shutil.copytree(ERNIE_TOKENIZER_DIR, moe, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    shutil.copy(moe_config, moe / "config.json")
    from erniekit_lite.run_plan import Launch

    figures = _memory_table()
    assert len(figures) == 12
    for name, stated in figures.items():
        path = ERNIE_TOKENIZER_DIR if name.startswith("ernie-4.5-0.3b") else moe
        recipe = recipes.load(str(ROOT / "recipes" / name), [f"model.path={path}", f"output.dir={tmp_path / 'out'}"])
        lines = []
        if name.endswith("-2gpu.yaml"):  # launched as its comment says: 2 processes, FSDP2; the figure is one GPU's
            plan(recipe, log=lines.append, launch=Launch("fsdp", 2))
            head = "memory per device (estimate) under this launch, sharded over its 2 processes (FSDP): "
            printed = next(x for x in lines if x.startswith(("memory per device", "  one process's plan")))
            assert printed.startswith(f"{head}about {stated} GiB; fits an 80 GB GPU"), (name, printed)  # the headline
            assert lines[lines.index(printed) + 1].startswith("  one process's plan, unsharded: "), (name, lines)
            continue
        plan(recipe, log=lines.append)
        printed = next(x for x in lines if x.startswith("memory per device (estimate): "))
        assert printed.split(": ")[1].startswith(f"{stated} GiB for "), (name, printed)


LONG_ROWS = [
    MC.Case("dense LoRA checkpointing, one 32k-token row", layers=2, lora=True, checkpointing=True, hidden=128, tokens=32768,
            samples=64, vocab=4096, chunk_elements=2**22),
    MC.Case("moe LoRA, one 32k-token row", arch="moe", layers=3, lora=True, hidden=128, tokens=32768, samples=64, vocab=4096,
            chunk_elements=2**22),
]


@pytest.mark.slow  # ~1 min: a forward and backward over 32,768 tokens each
@pytest.mark.parametrize("case", LONG_ROWS, ids=[c.name for c in LONG_ROWS])
def test_a_32k_token_packed_row_stays_within_the_plan(case, one_thread):
    """Long context: one packed row of 32,768 tokens (64 samples, per-sample attention, the LM head in 4M-element
    chunks) measured against the plan, with the bounds of the small shapes above. The 128k recipes' figures come
    from the same formula (docs/memory.md, "The shipped recipes"), not from a measurement here."""
    result = MC.measure(case)
    est, got = result["estimate"], result["measured"]
    for key in ("weights", "gradients", "optimizer"):
        assert est[key] == got[key], (key, est[key], got[key])
    assert 0.97 <= est["peak"] / got["peak"] <= 1.10, (est["peak"], got["peak"])


def test_counts_and_gpu_sizes_read_as_english():
    """"1 optimizer step", "1 row", "1 layer", "an 80 GB GPU" (they said "1 optimizer steps", "1 rows", "a 80 GB")."""
    from erniekit_lite import words
    from erniekit_lite.prune import Point

    assert [words.count(n, "optimizer step") for n in (1, 2)] == ["1 optimizer step", "2 optimizer steps"]
    assert [memory.a_gpu(gb) for gb in memory.GPUS_GB] == ["a 24 GB GPU", "a 48 GB GPU", "an 80 GB GPU", "a 141 GB GPU"]
    assert str(Point(layers=1, experts=None, top_k=None)) == "1 layer"
