"""QLoRA (`model.load_in_4bit`) without a GPU: bitsandbytes 0.50 quantizes to NF4 and computes on the CPU.

The base loads in 4-bit (every `nn.Linear` but the tied LM head, and the MoE's fused routed experts, which
model/expert_4bit.py quantizes; the router stays in fp32), computes as its dequantized weights do, adapters train
in bf16 as on the bf16 base, a saved adapter reloads in a fresh process with the same logits, `merge` writes the
dequantized base + adapter, and `validate`'s weight plan matches what is loaded.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEST_EXTRA, needs, optional
import torch
import yaml

from erniekit_lite.cli import main
from erniekit_lite.model.expert_4bit import is_4bit
from erniekit_lite.model.load import load_model
from erniekit_lite.model.lora import apply_lora
from erniekit_lite.recipe import LoraSection
from helpers import write_recipe

bnb = optional("bitsandbytes")  # the test extra installs it; `pip install 'erniekit-lite[qlora]'`
pytestmark = needs(bnb is not None, "bitsandbytes", TEST_EXTRA)

ROOT = Path(__file__).resolve().parents[1]
MERGE_TOLERANCE = 0.02  # max |logit| difference, merged model vs 4-bit base + adapter (bf16); measured: see the test
REFERENCE_TOLERANCE = 1e-2  # 4-bit experts vs the same weights dequantized up front: logits, relative LoRA gradients


def four_bit(path) -> torch.nn.Module:
    return load_model(str(path), "bfloat16", "packed_sdpa", load_in_4bit=True)


def linear_names(path) -> set[str]:
    model = load_model(str(path), "bfloat16", "sdpa")
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_the_base_loads_in_4bit_routed_experts_included(arch, tiny_own_dir, tiny_moe_dir):
    path = tiny_own_dir if arch == "dense" else tiny_moe_dir
    model = four_bit(path)
    quantized = {n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert quantized == linear_names(path) - {"lm_head"}  # ERNIE ties the head to the embeddings: it stays
    assert getattr(model, "is_loaded_in_4bit", False)
    experts = [m for m in model.modules() if is_4bit(m)]
    assert len(experts) == sum(hasattr(m, "experts") for m in model.modules()) and bool(experts) == (arch == "moe")
    for name, param in model.named_parameters():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):  # packed NF4, frozen, peft's shape
            assert param.dtype == torch.uint8 and not param.requires_grad and len(param.ds_shape) == 3, name
            assert param.numel() * 2 == param.ds_shape.numel(), name
        if name.endswith("mlp.gate.weight"):  # the router: not quantized
            assert param.dtype == torch.float32, name
    if arch == "moe":  # quantized as loaded (transformers' quantizer hook) = the loaded bf16 weights quantized after
        from erniekit_lite.model.expert_4bit import quantize_experts

        after = load_model(str(path), "bfloat16", "sdpa")
        quantize_experts(after, torch.bfloat16)
        loaded = dict(model.named_buffers()) | dict(model.named_parameters())
        for name, tensor in list(after.named_parameters()) + list(after.named_buffers()):
            if ".mlp.experts." in name and ".shared_experts." not in name:
                assert torch.equal(loaded[name], tensor), name


def test_4bit_experts_compute_as_their_dequantized_weights(tiny_moe_dir):
    """Logits (without and with an adapter) and LoRA gradients of the 4-bit-expert model against the same model
    with its experts dequantized once up front and run through the split path: within REFERENCE_TOLERANCE
    (measured on CPU, bf16: identical, 0.0)."""
    from erniekit_lite.model.expert_4bit import unquantize_experts

    torch.manual_seed(0)
    ids = torch.randint(5, 200, (2, 24))
    results = []
    for reference in (False, True):
        model = four_bit(tiny_moe_dir)
        if reference:
            unquantize_experts(model)
            assert not any(is_4bit(m) for m in model.modules())
        with torch.no_grad():
            base = model(input_ids=ids).logits.float()
        torch.manual_seed(0)
        peft_model = apply_lora(model, LoraSection(r=4, dropout=0.0))
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.02)
        out = peft_model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.float() for n, p in peft_model.named_parameters() if p.requires_grad}
        results.append((base, out.logits.detach().float(), grads))
    (base, logits, grads), (ref_base, ref_logits, ref_grads) = results
    assert any(".mlp.experts." in n and ".shared_experts." not in n and g.abs().sum() > 0 for n, g in grads.items())
    base_diff, diff = (base - ref_base).abs().max().item(), (logits - ref_logits).abs().max().item()
    grad_diff = max(((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-12)).item() for n in ref_grads)
    print(f"4-bit experts vs dequantized: logits {base_diff:.3g} (base), {diff:.3g} (adapter); LoRA gradients {grad_diff:.3g} (relative)")
    assert base_diff <= REFERENCE_TOLERANCE and diff <= REFERENCE_TOLERANCE and grad_diff <= REFERENCE_TOLERANCE


def test_4bit_experts_in_runs_of_rows_match_the_dequantized_experts(tiny_moe_dir, monkeypatch):
    """One MoE layer's 4-bit experts with an adapter, dequantized in runs of 8 rows (RUN_BYTES cut to force 8 and 16
    runs) and in one run, against the same experts dequantized up front: outputs and gradients within
    REFERENCE_TOLERANCE (bf16); tokens routed to experts 0 and 1 only, so the other experts' adapter gradients are
    exactly 0; a call with no tokens returns [0, hidden]. The released 21B-A3B widths run in whole runs under RUN_BYTES."""
    from erniekit_lite.model import expert_4bit
    from erniekit_lite.model.expert_lora import SplitExperts, wrappers

    assert expert_4bit.run_rows((64, 3072, 2560), 2) == 384 and expert_4bit.run_rows((64, 2560, 1536), 2) == 640
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=generator, dtype=torch.bfloat16)
    index, weights = torch.tensor([[0, 1], [1, 0]] * 3), torch.full((6, 2), 0.5)
    results = {}
    for case, run_bytes in (("runs", 1), ("one run", expert_4bit.RUN_BYTES), ("dequantized", None)):
        model = four_bit(tiny_moe_dir)
        if run_bytes is None:
            expert_4bit.unquantize_experts(model)
        monkeypatch.setattr(expert_4bit, "RUN_BYTES", run_bytes or expert_4bit.RUN_BYTES)
        torch.manual_seed(0)
        peft_model = apply_lora(model, LoraSection(r=4, dropout=0.0))
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
        wrapper = next(m for m in peft_model.modules() if isinstance(m, SplitExperts))
        chain, experts = wrappers(wrapper)
        if case == "runs":
            assert [len(expert_4bit.runs_of(experts, n, 2)) for n in expert_4bit.NAMES] == [8, 8]
        inputs = x.clone().requires_grad_(True)
        out = wrapper(inputs, index, weights)
        out.float().square().sum().backward()
        grads = {f"{n}.{f}": getattr(w, f)["default"].weight.grad.float() for n, w in chain.items() for f in ("lora_A", "lora_B")}
        results[case] = out.detach().float(), inputs.grad.float(), grads
        empty = wrapper(torch.zeros(0, 64, dtype=torch.bfloat16), index[:0], weights[:0])
        assert empty.shape == (0, 64)
    reference = results.pop("dequantized")
    for case, (out, input_grad, grads) in results.items():
        diffs = {what: ((got - want).norm() / want.norm()).item() for got, want, what in [
            (out, reference[0], "output"), (input_grad, reference[1], "input gradient")] + [(grads[n], reference[2][n], n) for n in grads]}
        print(f"4-bit experts ({case}) vs dequantized up front: largest relative difference {max(diffs.values()):.3g}")
        assert max(diffs.values()) <= REFERENCE_TOLERANCE, (case, diffs)
        for name, grad in grads.items():
            experts = 8
            per = grad.view(experts, -1, grad.shape[-1]) if "lora_A" in name else grad.view(grad.shape[0], -1, experts).permute(2, 1, 0)
            assert [bool(per[e].abs().max() > 0) for e in range(experts)] == [True, True] + [False] * 6, (case, name)


@pytest.mark.parametrize("shape", [(3, 128, 128), (3, 64, 32)])  # whole 256-blocks of absmax per expert, or not
def test_each_4bit_expert_dequantizes_as_bitsandbytes_dequantizes_the_stack(shape):
    """One quantization state for the stack, sliced per expert (ERNIE's widths: out·in a multiple of 64·256), or a
    state per expert (the tiny models): each expert's weight is what bitsandbytes itself dequantizes."""
    import bitsandbytes.functional as bnbf

    from erniekit_lite.model import expert_4bit

    torch.manual_seed(0)
    weight = torch.randn(shape, dtype=torch.bfloat16)
    module = torch.nn.Module()
    module.gate_up_proj = torch.nn.Parameter(weight.clone())
    expert_4bit.quantize(module, "gate_up_proj", torch.bfloat16)
    if shape[1] * shape[2] % (64 * 256) == 0:
        expected = bnbf.dequantize_4bit(*bnbf.quantize_4bit(weight.reshape(-1), blocksize=64, compress_statistics=True, quant_type="nf4"))
    else:
        expected = torch.stack([bnbf.dequantize_4bit(*bnbf.quantize_4bit(w.reshape(-1), blocksize=64, compress_statistics=True,
                                                                          quant_type="nf4")) for w in weight])
    assert torch.equal(expert_4bit.dequantize(module, "gate_up_proj"), expected.reshape(shape))
    assert module.gate_up_proj.dtype == torch.uint8 and module.gate_up_proj.numel() == weight.numel() // 2


def test_4bit_experts_refuse_the_merged_expert_compute(tiny_moe_dir):
    from erniekit_lite.errors import UserError

    with pytest.raises(UserError, match="lora.expert_compute: merged") as error:
        apply_lora(four_bit(tiny_moe_dir), LoraSection(r=4, dropout=0.0, expert_compute="merged"))
    assert "\n" not in str(error.value)


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


def qlora_recipe(tmp_path: Path, model_dir, load_in_4bit: bool = True, **train) -> Path:
    train = {"learning_rate": 1e-2, "max_steps": 40, "per_device_train_batch_size": 2, "logging_steps": 2,
             "save_steps": 40, "activation_checkpointing": False, "seed": 0, "bf16": True, **train}
    return write_recipe(tmp_path / "recipe.yaml", model_dir, model={"dtype": "bfloat16", "load_in_4bit": load_in_4bit},
                        lora={"r": 8, "alpha": 16, "dropout": 0.0}, output={"sample_prompts": ["Who are you?"]}, train=train)


LOSS_TOLERANCE = 0.15  # max |loss difference| per logged step, QLoRA vs the same recipe on the bf16 base; see below


def train_losses(tmp_path: Path, path, load_in_4bit: bool, capsys) -> list[float]:
    tmp_path.mkdir()
    code = main(["train", str(qlora_recipe(tmp_path, path, load_in_4bit))])
    _, err = capsys.readouterr()
    assert code == 0, err
    return [h["loss"] for h in json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"] if "loss" in h]


@pytest.mark.slow  # ~60 s per architecture on 2 cores
@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_qlora_trains_on_cpu_as_on_the_bf16_base_and_the_adapter_reloads_in_a_fresh_process(arch, tmp_path, capsys, tiny_own_dir, tiny_moe_dir):
    """The QLoRA run's loss per logged step follows the same recipe's on the bf16 base (no quantization, fp32
    adapters) within LOSS_TOLERANCE: NF4's rounding moves the losses a little (measured: see the printed figure),
    a broken 4-bit path (wrong weights, no gradient) far more. Then the saved adapter answers in a fresh process as
    training's last model did."""
    path = tiny_own_dir if arch == "dense" else tiny_moe_dir
    losses = train_losses(tmp_path / "qlora", path, True, capsys)
    reference = train_losses(tmp_path / "bf16", path, False, capsys)
    gap = max(abs(a - b) for a, b in zip(losses, reference))
    with capsys.disabled():
        print(f"QLoRA {arch}: loss {losses[0]:.3f} -> {losses[-1]:.3f}; bf16 base {reference[0]:.3f} -> {reference[-1]:.3f}; "
              f"largest per-step gap {gap:.3f}")
    assert len(losses) == len(reference) == 20
    assert gap <= LOSS_TOLERANCE, (losses, reference)
    assert losses[-1] < 0.9 * losses[0], losses
    run = tmp_path / "qlora" / "out"
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


@contextlib.contextmanager
def routing(model, recorded: list):
    """Record each MoE router's output (expert choices and weights) in call order into an empty `recorded`, or
    replay a recorded one: compares two models' experts with the same tokens routed to the same experts."""
    replay, calls = bool(recorded), iter(list(recorded))

    def hook(module, args, output):
        if replay:
            return next(calls)
        recorded.append(output)

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("arch", ["dense", pytest.param("moe", marks=pytest.mark.slow)])  # ~27 s each on 2 cores
def test_a_saved_4bit_adapter_reloads_exactly_and_merges_dequantized(arch, tmp_path, tiny_own_dir, tiny_moe_dir):
    """Logits of the 4-bit base + adapter (the MoE's on 4-bit routed experts too): equal after a reload in a fresh
    process; the saved adapter holds adapter weights only; `merge` writes a plain checkpoint (the dequantized 4-bit
    base with the adapter added, no quantization config) within MERGE_TOLERANCE of them, where merging into the
    original weights is not. Both dense and MoE; the merged MoE runs with the 4-bit model's routing: the merged
    weights' bf16 rounding can flip a token's top-k expert choice, which moves that one position's logits by more
    (measured without fixed routing: 0.045 at one of 24 positions); with it, 0.0078 dense, 0.0059 MoE."""
    from transformers import AutoModelForCausalLM

    from erniekit_lite.model.merge import merge

    path = tiny_own_dir if arch == "dense" else tiny_moe_dir
    model = apply_lora(four_bit(path), LoraSection(r=4, dropout=0.0)).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)  # a trained adapter's size: its update small next to the weights
    ids = torch.randint(5, 200, (1, 24))
    routes: list = []
    with torch.no_grad(), routing(model, routes):
        expected = model(input_ids=ids).logits.float()
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    from safetensors import safe_open

    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        assert all(".lora_" in key for key in f.keys())  # noqa: SIM118  (safe_open has no __iter__)  # never the (4-bit) base's weights
    (adapter / "recipe.yaml").write_text(yaml.safe_dump({"model": {"path": str(path), "dtype": "bfloat16", "load_in_4bit": True}}))
    torch.save(ids, tmp_path / "ids.pt")
    subprocess.run([sys.executable, "-c", RELOAD_SCRIPT, str(adapter), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")], check=True)
    assert torch.equal(torch.load(tmp_path / "out.pt").float(), expected)

    merged_dir = merge(str(adapter), str(tmp_path / "merged"))
    config = json.loads((merged_dir / "config.json").read_text())
    assert "quantization_config" not in config
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.bfloat16).eval()
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in merged.modules())
    with torch.no_grad(), routing(merged, routes):
        got = merged(input_ids=ids).logits.float()
    diff = (got - expected).abs().max().item()
    print(f"{arch}: merged vs 4-bit + adapter: max |logit difference| {diff:.4g} (logits up to {expected.abs().max().item():.3g})")
    assert diff <= MERGE_TOLERANCE, diff
    assert json.loads((merged_dir / "erniekit_merged.json").read_text())["dequantized_4bit"] is True
    # the same adapter merged into the original (unquantized) weights answers further from the trained model
    (adapter / "recipe.yaml").unlink()
    original_model = AutoModelForCausalLM.from_pretrained(merge(str(adapter), str(tmp_path / "merged-original")), dtype=torch.bfloat16)
    with torch.no_grad(), routing(original_model, routes):
        original = original_model(input_ids=ids).logits.float()
    assert (original - expected).abs().max().item() > diff


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_validate_plans_the_4bit_weights_loaded(arch, tmp_path, capsys, tiny_own_dir, tiny_moe_dir):
    """The plan's weights term for a 4-bit base against what the loaded model holds: its parameters (packed NF4
    bytes, the MoE's routed experts included, the rest in model.dtype, bf16 adapters) plus the quantization states
    (absmax, codes, the experts' statistics). Within 1%."""
    from erniekit_lite import recipe as recipes
    from erniekit_lite.model.expert_4bit import stack_bytes
    from erniekit_lite.run_plan import architecture, memory_estimate
    from erniekit_lite.trainer_args import training_args

    path = tiny_own_dir if arch == "dense" else tiny_moe_dir
    recipe = recipes.load(str(qlora_recipe(tmp_path, path)), [])
    args = training_args(recipe, tmp_path / "out")
    est, _ = memory_estimate(recipe, args, architecture(str(path), recipe), cuda=True)
    model = apply_lora(four_bit(path), recipe.lora)  # the adapters count too (bf16)
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state = module.weight.quant_state
            parts = [state.absmax, state.code] + ([state.state2.absmax, state.state2.code, state.offset] if state.nested else [])
            loaded += sum(t.numel() * t.element_size() for t in parts)
        if is_4bit(module):  # the packed weights are parameters (counted above); their statistics are buffers
            experts += stack_bytes(module)
            loaded += stack_bytes(module) - sum(getattr(module, n).numel() for n in module.nf4_shapes)
    with capsys.disabled():
        print(f"4-bit weights ({arch}): planned {est.weights:,} B, loaded {loaded:,} B, of which routed experts {experts:,} B")
    assert abs(est.weights / loaded - 1) <= 0.01
    assert (experts > 0) == (arch == "moe")
    code = main(["validate", str(qlora_recipe(tmp_path, path))])
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
