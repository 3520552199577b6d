"""QLoRA (`model.load_in_4bit`) without a GPU: bitsandbytes 0.50 quantizes to NF4 and computes on the CPU.

The base loads in 4-bit (every `nn.Linear` but the tied LM head; the MoE router and fused routed experts stay in
`model.dtype`), adapters train in bf16 with falling loss, a saved adapter reloads in a fresh process with the
same logits, `merge` writes the dequantized base + adapter, and `validate`'s weight plan matches what is loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEST_EXTRA, needs, optional
import torch
import yaml

from erniekit_lite.cli import main
from erniekit_lite.model.load import load_model
from erniekit_lite.model.lora import apply_lora
from erniekit_lite.recipe import LoraSection
from helpers import write_recipe

bnb = optional("bitsandbytes")  # the test extra installs it; `pip install 'erniekit-lite[qlora]'`
pytestmark = needs(bnb is not None, "bitsandbytes", TEST_EXTRA)

ROOT = Path(__file__).resolve().parents[1]
MERGE_TOLERANCE = 0.02  # max |logit| difference, merged model vs 4-bit base + adapter (bf16, dense); measured 0.0078


def four_bit(path) -> torch.nn.Module:
    return load_model(str(path), "bfloat16", "packed_sdpa", load_in_4bit=True)


def linear_names(path) -> set[str]:
    model = load_model(str(path), "bfloat16", "sdpa")
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_the_base_loads_in_4bit_except_what_bitsandbytes_leaves(arch, tiny_own_dir, tiny_moe_dir):
    path = tiny_own_dir if arch == "dense" else tiny_moe_dir
    model = four_bit(path)
    quantized = {n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert quantized == linear_names(path) - {"lm_head"}  # ERNIE ties the head to the embeddings: it stays
    assert getattr(model, "is_loaded_in_4bit", False)
    for name, param in model.named_parameters():
        if ".mlp.experts." in name or name.endswith("mlp.gate.weight"):  # fused experts and the router: not nn.Linear
            assert param.dtype in (torch.bfloat16, torch.float32) and not isinstance(param, bnb.nn.Params4bit), name
    if arch == "moe":
        assert any(".mlp.experts.gate_up_proj" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("setup", ["float32", "bfloat16", "bfloat16 under ZeRO-3", "4-bit"])
def test_adapter_dtypes(setup, tiny_own_dir, monkeypatch):
    """peft upcasts adapters to fp32 by default; under ZeRO-3 they keep the base's dtype (TRL's rule, trl#6089);
    on a 4-bit base they are bf16 (TRL's QLoRA rule)."""
    import transformers.integrations.deepspeed as deepspeed

    if setup == "4-bit":
        model = four_bit(tiny_own_dir)
    else:
        model = load_model(str(tiny_own_dir), setup.split()[0], "sdpa")
    monkeypatch.setattr(deepspeed, "is_deepspeed_zero3_enabled", lambda: setup.endswith("ZeRO-3"))
    peft_model = apply_lora(model, LoraSection(r=4, dropout=0.0))
    dtypes = {p.dtype for n, p in peft_model.named_parameters() if p.requires_grad}
    expected = {"float32": torch.float32, "bfloat16": torch.float32, "bfloat16 under ZeRO-3": torch.bfloat16, "4-bit": torch.bfloat16}
    assert dtypes == {expected[setup]}


def test_an_eval_pass_does_not_break_training_through_the_4bit_weights(tiny_own_dir):
    """bitsandbytes repacks a 4-bit weight for its CPU inference kernel at the first eval-mode forward without
    gradients; through the repacked weight backward gives no input gradient. The loader keeps the layout."""
    results = []
    for eval_first in (False, True):
        model = four_bit(tiny_own_dir)
        layer = model.model.layers[0].self_attn.q_proj
        torch.manual_seed(0)
        x = torch.randn(4, layer.in_features, dtype=torch.bfloat16)
        if eval_first:
            layer.eval()
            with torch.no_grad():
                layer(x)
        layer.train()
        x.requires_grad_(True)
        layer(x).float().pow(2).sum().backward()
        assert x.grad is not None
        results.append(x.grad)
    assert torch.equal(*results)


def qlora_recipe(tmp_path: Path, model_dir, **train) -> Path:
    train = {"learning_rate": 1e-2, "max_steps": 40, "per_device_train_batch_size": 2, "logging_steps": 2,
             "save_steps": 40, "activation_checkpointing": False, "seed": 0, "bf16": True, **train}
    return write_recipe(tmp_path / "recipe.yaml", model_dir, model={"dtype": "bfloat16", "load_in_4bit": True},
                        lora={"r": 8, "alpha": 16, "dropout": 0.0}, output={"sample_prompts": ["Who are you?"]}, train=train)


@pytest.mark.slow  # ~30 s per architecture on 2 cores
@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_qlora_trains_on_cpu_and_the_adapter_reloads_in_a_fresh_process(arch, tmp_path, capsys, tiny_own_dir, tiny_moe_dir):
    path = tiny_own_dir if arch == "dense" else tiny_moe_dir
    code = main(["train", str(qlora_recipe(tmp_path, path))])
    out, err = capsys.readouterr()
    assert code == 0, err
    run = tmp_path / "out"
    losses = [h["loss"] for h in json.loads((run / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    print(f"QLoRA {arch}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < 0.9 * losses[0], losses
    assert (run / "adapter_model.safetensors").is_file()
    trained = json.loads((run / "samples.jsonl").read_text().splitlines()[0])["answer"]
    # A fresh process loads the base in 4-bit and the adapter, and answers greedily what training's last model did
    chat = subprocess.run([sys.executable, "-m", "erniekit_lite", "chat", str(run), "--prompt", "Who are you?", "--max-new-tokens", "32"],
                          capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0, chat.stderr[-2000:]
    assert chat.stdout.strip().endswith(trained.strip()), (chat.stdout, trained)


RELOAD_SCRIPT = """
import sys, torch
from erniekit_lite.model.load import load_model
model = load_model(sys.argv[1], "bfloat16", "packed_sdpa", trainable_adapter=False, load_in_4bit=True)
with torch.no_grad():
    torch.save(model(input_ids=torch.load(sys.argv[2])).logits, sys.argv[3])
"""


def test_a_saved_4bit_adapter_reloads_exactly_and_merges_dequantized(tmp_path, tiny_own_dir):
    """Logits of the 4-bit base + adapter: equal after a reload in a fresh process; `merge` writes a plain
    checkpoint (the dequantized 4-bit base with the adapter added, no quantization config) within
    MERGE_TOLERANCE of them, where merging into the original weights is not. On the dense model: in an MoE the
    merged weights' bf16 rounding (~0.004 here) can flip a token's top-k expert choice, which moves that one
    position's logits by far more (seen: 0.024 and 0.046 at one of 24 positions, 0.004 elsewhere)."""
    tiny_moe_dir = tiny_own_dir  # the checkpoint under test (dense: see above)
    from transformers import AutoModelForCausalLM

    from erniekit_lite.model.merge import merge

    model = apply_lora(four_bit(tiny_moe_dir), LoraSection(r=4, dropout=0.0)).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)  # a trained adapter's size: its update small next to the weights
    ids = torch.randint(5, 200, (1, 24))
    with torch.no_grad():
        expected = model(input_ids=ids).logits.float()
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    (adapter / "recipe.yaml").write_text(yaml.safe_dump({"model": {"path": str(tiny_moe_dir), "dtype": "bfloat16", "load_in_4bit": True}}))
    torch.save(ids, tmp_path / "ids.pt")
    subprocess.run([sys.executable, "-c", RELOAD_SCRIPT, str(adapter), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")], check=True)
    assert torch.equal(torch.load(tmp_path / "out.pt").float(), expected)

    merged_dir = merge(str(adapter), str(tmp_path / "merged"))
    config = json.loads((merged_dir / "config.json").read_text())
    assert "quantization_config" not in config
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.bfloat16).eval()
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in merged.modules())
    with torch.no_grad():
        got = merged(input_ids=ids).logits.float()
    diff = (got - expected).abs().max().item()
    print(f"merged vs 4-bit + adapter: max |logit difference| {diff:.4g} (logits up to {expected.abs().max().item():.3g})")
    assert diff <= MERGE_TOLERANCE, diff
    assert json.loads((merged_dir / "erniekit_merged.json").read_text())["dequantized_4bit"] is True
    # the same adapter merged into the original (unquantized) weights answers further from the trained model
    (adapter / "recipe.yaml").unlink()
    with torch.no_grad():
        original = AutoModelForCausalLM.from_pretrained(merge(str(adapter), str(tmp_path / "merged-original")), dtype=torch.bfloat16)(input_ids=ids).logits.float()
    assert (original - expected).abs().max().item() > diff


def test_validate_plans_the_4bit_weights_loaded(tmp_path, capsys, tiny_own_dir):
    """The plan's weights term for a 4-bit base against what the loaded model holds: its parameters (packed NF4
    bytes, the rest in model.dtype, bf16 adapters) plus the quantization states (absmax, codes). Within 1%."""
    from erniekit_lite import recipe as recipes
    from erniekit_lite.plan import architecture, memory_estimate
    from erniekit_lite.trainer_args import training_args

    recipe = recipes.load(str(qlora_recipe(tmp_path, tiny_own_dir)), [])
    args = training_args(recipe, tmp_path / "out")
    est, _ = memory_estimate(recipe, args, architecture(str(tiny_own_dir), recipe), cuda=True)
    model = apply_lora(four_bit(tiny_own_dir), recipe.lora)  # the adapters count too (bf16)
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state = module.weight.quant_state
            parts = [state.absmax, state.code] + ([state.state2.absmax, state.state2.code, state.offset] if state.nested else [])
            loaded += sum(t.numel() * t.element_size() for t in parts)
    print(f"4-bit weights: planned {est.weights:,} B, loaded {loaded:,} B")
    assert abs(est.weights / loaded - 1) <= 0.01
    code = main(["validate", str(qlora_recipe(tmp_path, tiny_own_dir))])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "bf16 autocast, 4-bit base" in out and "needs a CUDA GPU" not in out


def test_without_bitsandbytes_qlora_is_one_line(tmp_path, capsys, tiny_own_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    code = main(["train", str(qlora_recipe(tmp_path, tiny_own_dir))])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: model.load_in_4bit: bitsandbytes is not installed; pip install 'erniekit-lite[qlora]'"
    ]
    assert not (tmp_path / "out").exists()
