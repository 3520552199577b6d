"""LoRA variants: rsLoRA, DoRA, peft's initialisations and LoRA+ (`lora.use_rslora`, `lora.use_dora`, `lora.init`,
`lora.plus_lr_ratio`).

Each is trained from the CLI for 2 steps on the tiny dense model, and on the tiny MoE where peft supports it; the
trained model's logits (read inside the run, just before the final save) equal those of the run dir reloaded by our
loader, and `merge` writes a plain checkpoint whose logits equal the adapter's: both within TOL (max |logit
difference|, fp32). Then what the variant is: the scale every adapter uses, DoRA's magnitudes, PiSSA/OLoRA's changed
base weights (and the adapter saved as a plain rank-2r LoRA), the optimizer's learning rate per parameter group.
Combinations peft 0.21.2 refuses (pinned below) are one line each.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import TEST_EXTRA, need_module
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from erniekit_lite.errors import UserError
from erniekit_lite.model.load import load_model
from erniekit_lite.model.lora import apply_lora, lora_config, targets_as_written
from erniekit_lite.recipe import LoraSection
from erniekit_lite.train import callbacks
from helpers import run_cli, write_recipe

TOL = 1e-5  # max |logit difference| in fp32: trained vs reloaded, reloaded vs merged (measured: 0 to 5e-7)
# Timings (2 CPU cores): each dense run ~0.7 s idle; the same tests took 5-16 s while other jobs loaded the machine
R, ALPHA, LR, DECAY = 4, 8, 1e-2, 0.01
IDS = torch.randint(5, 200, (1, 24), generator=torch.Generator().manual_seed(0))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def train(tmp_path, capsys, monkeypatch, model_dir, lora: dict, method: str = "sft") -> SimpleNamespace:
    """A 2-step CLI run; what the trainer held just before the final save: logits, the model, optimizer groups."""
    seen = SimpleNamespace()
    save_final = callbacks.save_final

    def spy(trainer, out, metrics, expert_load=None):
        model = trainer.model
        training = model.training
        seen.logits, seen.model, seen.initial = logits(model), model, trainer.initial_adapter
        model.train(training)
        names = {id(p): n for n, p in model.named_parameters()}
        seen.groups = [(g["initial_lr"], g["weight_decay"], [names[id(p)] for p in g["params"]]) for g in trainer.optimizer.param_groups]
        seen.trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        return save_final(trainer, out, metrics, expert_load)

    monkeypatch.setattr(callbacks, "save_final", spy)
    recipe = write_recipe(tmp_path / "recipe.yaml", model_dir, method=method, lora={"r": R, "alpha": ALPHA, **lora}, out=tmp_path / "run",
                          train={"learning_rate": LR, "weight_decay": DECAY, "max_steps": 2, "per_device_train_batch_size": 2,
                                 "activation_checkpointing": False, "logging_steps": 1, "seed": 0})
    code, out, err = run_cli(capsys, "train", recipe)
    assert code == 0, err
    seen.run, seen.out = tmp_path / "run", out
    seen.config = json.loads((seen.run / "adapter_config.json").read_text())
    return seen


def reloads_and_merges(tmp_path, trained) -> torch.nn.Module:
    """The run dir reloads with the trained logits, and merges into a plain checkpoint with the same logits."""
    from transformers import AutoModelForCausalLM

    from erniekit_lite.model.merge import merge

    reloaded = load_model(str(trained.run), "float32", "sdpa")
    adapter = logits(reloaded)
    assert (adapter - trained.logits).abs().max().item() <= TOL
    merged_dir = merge(str(trained.run), str(tmp_path / "merged"))
    assert not (merged_dir / "adapter_config.json").exists()
    with safe_open(str(merged_dir / "model.safetensors"), "pt") as f:
        assert not any("lora" in k for k in f.keys())
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert not hasattr(merged, "peft_config")
    assert (logits(merged) - adapter).abs().max().item() <= TOL
    return reloaded


def lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def check_scaling(model, rslora: bool) -> None:
    """Every adapter, the MoE's fused rank-2r gate+up included, at the scale of rank R: alpha/sqrt(r) or alpha/r."""
    want = ALPHA / math.sqrt(R) if rslora else ALPHA / R
    layers = lora_layers(model)
    assert layers
    for name, module in layers:
        assert module.scaling["default"] == pytest.approx(want), name


def check_lora_plus(trained, ratio: float) -> None:
    """B matrices at ratio x learning_rate, A matrices at learning_rate, weight decay as train.weight_decay; every
    trainable parameter in one group."""
    grouped = [n for _, _, names in trained.groups for n in names]
    assert sorted(grouped) == sorted(trained.trainable)
    for lr, decay, names in trained.groups:
        if not names:
            continue
        kinds = {"B" if ".lora_B." in n else "A" if ".lora_A." in n else n for n in names}
        assert len(kinds) == 1, kinds
        assert lr == pytest.approx(LR * ratio if kinds == {"B"} else LR), kinds
        assert decay == pytest.approx(DECAY)
    assert any(".lora_B." in n for _, _, names in trained.groups for n in names)


def check_moved_base(trained, base_dir: Path) -> None:
    """PiSSA/OLoRA as peft does it: the trained model's base weights are the originals minus the initial adapter
    (W_res = W - s B0 A0, visibly different from W); the run dir holds a plain rank-2r LoRA on the original base."""
    original = load_file(base_dir / "model.safetensors")
    initial = trained.initial
    checked = 0
    for name, module in lora_layers(trained.model):
        key = name.removeprefix("base_model.model.") + ".weight"
        if key not in original:
            continue
        w, w_res = original[key], module.get_base_layer().weight.detach()
        a0, b0 = initial[f"{name}.lora_A.weight"], initial[f"{name}.lora_B.weight"]
        assert (w_res - w).abs().max().item() > 1e-3, name
        assert (w_res + module.scaling["default"] * b0 @ a0 - w).abs().max().item() <= 1e-5, name
        checked += 1
    assert checked
    assert trained.config["init_lora_weights"] is True and trained.config["r"] == 2 * R and trained.config["lora_alpha"] == 2 * ALPHA
    with safe_open(str(trained.run / "adapter_model.safetensors"), "pt") as f:
        a = next(k for k in f.keys() if ".lora_A." in k)
        assert f.get_slice(a).get_shape()[0] == 2 * R


DENSE = {
    "rslora": {"use_rslora": True},
    "dora": {"use_dora": True},
    "pissa": {"init": "pissa"},
    "pissa_niter": {"init": "pissa_niter_2"},
    "olora": {"init": "olora"},
    "orthogonal": {"init": "orthogonal"},
    "gaussian": {"init": "gaussian"},
    "mica": {"init": "mica"},
    "loraplus": {"plus_lr_ratio": 4},
}


@pytest.mark.parametrize("variant", list(DENSE))
def test_dense_variant_trains_reloads_and_merges(variant, tmp_path, capsys, monkeypatch, tiny_own_dir):
    lora = DENSE[variant]
    trained = train(tmp_path, capsys, monkeypatch, tiny_own_dir, lora)
    reloaded = reloads_and_merges(tmp_path, trained)
    check_scaling(reloaded, rslora=lora.get("use_rslora", False))
    assert trained.config["use_rslora"] is lora.get("use_rslora", False)
    assert trained.config["use_dora"] is lora.get("use_dora", False)
    init = lora.get("init", True)
    if init in ("pissa", "pissa_niter_2", "olora"):
        check_moved_base(trained, tiny_own_dir)
    else:
        assert trained.config["init_lora_weights"] == init and trained.config["r"] == R
    if lora.get("use_dora"):
        with safe_open(str(trained.run / "adapter_model.safetensors"), "pt") as f:
            magnitudes = [k for k in f.keys() if "lora_magnitude_vector" in k]
        assert len(magnitudes) == len(lora_layers(reloaded))  # one magnitude vector per adapted weight
        moved = 0
        for name, module in lora_layers(reloaded):
            m = module.lora_magnitude_vector["default"].weight
            assert m.shape == (module.out_features,)
            norm = module.get_base_layer().weight.norm(dim=1)  # DoRA starts each magnitude at its row's norm
            moved += int((m - norm).abs().max().item() > 1e-6)
        assert moved  # and training moved them
    if init == "mica":  # B holds the base's minor singular directions and stays frozen: only A trains
        assert not any(".lora_B." in n for n in trained.trainable)
    if "plus_lr_ratio" in lora:
        check_lora_plus(trained, lora["plus_lr_ratio"])
    else:
        assert {lr for lr, _, names in trained.groups if names} == {LR}


@pytest.mark.slow  # three runs saving a checkpoint every step: ~3 s on an idle 2-core machine, 16 s loaded
def test_a_pissa_run_resumes_exactly_and_its_checkpoints_load(tmp_path, capsys, monkeypatch, tiny_own_dir):
    """Checkpoints keep peft's own PiSSA form (only the final save is converted): resuming loads them into the
    changed base the run re-creates, and continues exactly as an uninterrupted run; a checkpoint dir loads through
    peft, which redoes the (deterministic) SVD on the original base."""
    finals = []
    save_final = callbacks.save_final

    def spy(trainer, out, metrics, expert_load=None):
        finals.append(logits(trainer.model))
        return save_final(trainer, out, metrics, expert_load)

    monkeypatch.setattr(callbacks, "save_final", spy)

    def run(name, steps, **more):
        recipe = write_recipe(tmp_path / f"{name}.yaml", tiny_own_dir, lora={"r": R, "alpha": ALPHA, "init": "pissa"}, out=tmp_path / name,
                              train={"learning_rate": LR, "lr_scheduler_type": "constant", "max_steps": steps, "save_steps": 1,
                                     "per_device_train_batch_size": 2, "activation_checkpointing": False, "seed": 0, **more})
        code, _, err = run_cli(capsys, "train", recipe)
        assert code == 0, err

    run("straight", 3)
    run("resumed", 2)
    run("resumed", 3, resume_from_checkpoint=True)
    straight, two_steps, resumed = finals
    assert (resumed - straight).abs().max().item() <= TOL
    assert json.loads((tmp_path / "resumed" / "checkpoint-2" / "adapter_config.json").read_text())["init_lora_weights"] == "pissa"
    assert json.loads((tmp_path / "resumed" / "adapter_config.json").read_text())["r"] == 2 * R
    assert (logits(load_model(str(tmp_path / "resumed" / "checkpoint-2"), "float32", "sdpa")) - two_steps).abs().max().item() <= TOL
    assert (logits(load_model(str(tmp_path / "resumed"), "float32", "sdpa")) - resumed).abs().max().item() <= TOL


MOE = {
    "rslora+loraplus": {"use_rslora": True, "plus_lr_ratio": 4},
    "dora": {"use_dora": True, "routed_experts": False},
    "pissa": {"init": "pissa", "routed_experts": False},
    "olora": {"init": "olora", "routed_experts": False},
}
SLOW = pytest.mark.slow  # the fused routed experts: ~1.2 s idle, 11 s loaded


@pytest.mark.parametrize("variant", [pytest.param(v, marks=SLOW) if MOE[v].get("routed_experts", True) else v for v in MOE])
def test_moe_variant_trains_reloads_and_merges(variant, tmp_path, capsys, monkeypatch, tiny_moe_dir):
    """Where peft supports it on the MoE: rsLoRA and LoRA+ everywhere (the fused routed experts' rank-2r gate+up
    adapter keeps rank r's scale: alpha x sqrt(2) under rsLoRA); DoRA and PiSSA with routed_experts: false."""
    lora = MOE[variant]
    trained = train(tmp_path, capsys, monkeypatch, tiny_moe_dir, lora)
    reloaded = reloads_and_merges(tmp_path, trained)
    check_scaling(reloaded, rslora=lora.get("use_rslora", False))
    routed = [n for n, _ in lora_layers(reloaded) if ".experts" in n and ".shared_experts" not in n]
    assert bool(routed) == lora.get("routed_experts", True)
    if "plus_lr_ratio" in lora:
        check_lora_plus(trained, lora["plus_lr_ratio"])
        assert any(".experts.lora_B." in n for _, _, names in trained.groups for n in names)
    if lora.get("use_dora"):
        assert trained.config["use_dora"] is True
        assert any("lora_magnitude_vector" in n for n, _ in reloaded.named_parameters())
    if lora.get("init") == "pissa":
        check_moved_base(trained, tiny_moe_dir)


def test_dpo_with_lora_plus_and_rslora(tmp_path, capsys, monkeypatch, tiny_own_dir):
    """TRL makes DPO's adapter from our config: LoRA+ still builds the optimizer, rsLoRA is in the saved adapter."""
    trained = train(tmp_path, capsys, monkeypatch, tiny_own_dir, {"use_rslora": True, "plus_lr_ratio": 12}, method="dpo")
    check_lora_plus(trained, 12)
    assert trained.config["use_rslora"] is True
    check_scaling(reloads_and_merges(tmp_path, trained), rslora=True)


@SLOW
def test_moe_dpo_with_lora_plus_and_rslora(tmp_path, capsys, monkeypatch, tiny_moe_dir):
    trained = train(tmp_path, capsys, monkeypatch, tiny_moe_dir, {"use_rslora": True, "plus_lr_ratio": 12}, method="dpo")
    check_lora_plus(trained, 12)
    check_scaling(reloads_and_merges(tmp_path, trained), rslora=True)


@pytest.mark.slow  # QLoRA on CPU: ~1 s idle, 8-14 s on a loaded 2-core machine
def test_dora_on_a_4bit_base_trains_reloads_and_merges_dequantized(tmp_path, capsys, monkeypatch, tiny_own_dir):
    """DoRA with QLoRA (peft dequantizes the 4-bit weight for the magnitude's norm): the reload is exact; the merge
    (into the dequantized base) within the QLoRA merge tolerance of tests/test_qlora.py, 0.02."""
    need_module("bitsandbytes", TEST_EXTRA)
    from transformers import AutoModelForCausalLM

    from erniekit_lite.model.merge import merge

    seen = SimpleNamespace()
    save_final = callbacks.save_final

    def spy(trainer, out, metrics, expert_load=None):
        seen.logits = logits(trainer.model).float()
        return save_final(trainer, out, metrics, expert_load)

    monkeypatch.setattr(callbacks, "save_final", spy)
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_own_dir, lora={"r": R, "alpha": ALPHA, "use_dora": True}, out=tmp_path / "run",
                          model={"load_in_4bit": True}, train={"learning_rate": LR, "max_steps": 2, "per_device_train_batch_size": 2,
                                                              "activation_checkpointing": False, "seed": 0})
    code, _, err = run_cli(capsys, "train", recipe)
    assert code == 0, err
    reloaded = logits(load_model(str(tmp_path / "run"), "float32", "sdpa", load_in_4bit=True)).float()
    assert (reloaded - seen.logits).abs().max().item() <= TOL
    merged = AutoModelForCausalLM.from_pretrained(merge(str(tmp_path / "run"), str(tmp_path / "merged")))
    assert (logits(merged).float() - reloaded).abs().max().item() <= 0.02


# --- refusals: one line each -------------------------------------------------------------------------------------

def one_line(capsys, *argv) -> str:
    code, _, err = run_cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("init, words", [
    (False, "lora.init: false is peft's debugging setting"),
    ("eva", "lora.init: eva is computed from the training data"),
    ("corda", "lora.init: corda is computed from the training data"),
    ("lora_ga", "lora.init: lora_ga is computed from the training data"),
    ("loftq", "lora.init: loftq quantizes the base itself"),
    ("pisa", "lora.init: unknown init 'pisa'"),
    ("pissa_niter_x", "lora.init: unknown init 'pissa_niter_x'"),
])
def test_inits_not_offered_are_one_line(init, words, tmp_path, capsys, tiny_own_dir):
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_own_dir, lora={"init": init})
    assert words in one_line(capsys, "validate", recipe)


def test_lora_plus_ratio_must_be_positive(tmp_path, capsys, tiny_own_dir):
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_own_dir, lora={"plus_lr_ratio": 0})
    assert "lora.plus_lr_ratio" in one_line(capsys, "validate", recipe)


def test_validate_plans_inits_that_read_the_weights(tmp_path, capsys, tiny_own_dir):
    """`validate` builds the model on the meta device, where PiSSA's SVD cannot run: it counts the same parameters."""
    counts = []
    for init in (True, "pissa", "mica"):
        recipe = write_recipe(tmp_path / "recipe.yaml", tiny_own_dir, lora={"init": init})
        code, out, err = run_cli(capsys, "validate", recipe)
        assert code == 0, err
        counts.append(next(line for line in out.splitlines() if "trainable (LoRA" in line))
    assert len(set(counts)) == 1
    code, out, err = run_cli(capsys, "validate", write_recipe(tmp_path / "recipe.yaml", tiny_own_dir, lora={"use_dora": True}))
    assert code == 0 and "note: lora.use_dora: not in the estimate" in out, err  # the plan says what it leaves out


def moe(tiny_moe_dir):
    return load_model(str(tiny_moe_dir), "float32", "sdpa")


@pytest.mark.parametrize("settings, words", [
    ({"use_dora": True}, "lora.use_dora: peft 0.21.2 has no DoRA for the MoE's fused routed-expert weights"),
    ({"init": "pissa"}, "lora.init: peft 0.21.2 cannot start the MoE's fused routed-expert adapters as pissa"),
    ({"init": "olora"}, "as olora"),
    ({"init": "orthogonal"}, "as orthogonal"),
    ({"init": "mica"}, "as mica"),
])
def test_moe_routed_experts_refuse_what_peft_cannot_do_there(settings, words, tiny_moe_dir):
    with pytest.raises(UserError, match="set lora.routed_experts=false") as e:
        apply_lora(moe(tiny_moe_dir), LoraSection(r=R, **settings))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_odd_rank_orthogonal_and_dora_with_mica_are_one_line(tiny_own_dir):
    dense = load_model(str(tiny_own_dir), "float32", "sdpa")
    with pytest.raises(UserError, match=r"^lora.init: orthogonal needs an even lora.r \(got 3\)$"):
        apply_lora(dense, LoraSection(r=3, init="orthogonal"))
    with pytest.raises(UserError, match="^lora.use_dora: peft 0.21.2 cannot combine DoRA with lora.init mica"):
        apply_lora(dense, LoraSection(use_dora=True, init="mica"))


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "orthogonal", "mica"])
def test_inits_that_need_float_weights_are_refused_on_a_4bit_base(init, tiny_own_dir):
    need_module("bitsandbytes", TEST_EXTRA)
    with pytest.raises(UserError, match=f"^lora.init: {init} on a 4-bit base") as e:
        apply_lora(load_model(str(tiny_own_dir), "float32", "sdpa", load_in_4bit=True), LoraSection(r=R, init=init))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("method", ["dpo", "kto", "grpo"])
def test_reference_methods_refuse_inits_that_change_the_base_in_the_recipe(tmp_path, capsys, tiny_own_dir, method):
    """The reference of DPO, KTO and GRPO is the base with the adapter disabled: a recipe error (validate says it
    too), pointed at `init:`, before anything loads or the run dir is claimed."""
    extra = {"rewards": [{"name": "length"}]} if method == "grpo" else {}
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_own_dir, method=method, lora={"init": "olora"}, out=tmp_path / "run", **extra)
    line = Path(recipe).read_text().splitlines().index("  init: olora") + 1
    said = (f"error: {recipe}:{line}: lora.init: olora moves part of each base weight into the adapter, and {method.upper()}'s "
            f"reference is the base with the adapter disabled, which would then be the changed base; use lora.init true, "
            f"gaussian, orthogonal or mica for {method}")
    assert one_line(capsys, "train", recipe) == said and one_line(capsys, "validate", recipe) == said
    assert not (tmp_path / "run").exists()


def test_lora_plus_refuses_optimizers_that_group_parameters_themselves():
    """GaLore/LOMO-style optimizers hand the Trainer their own parameter groups; a DeepSpeed optimizer block replaces
    the Trainer's optimizer: both would drop LoRA+ silently."""
    from erniekit_lite.train import optimizer

    # a stand-in trainer: what the two checks read of the Trainer
    stub = SimpleNamespace(optimizer=None, optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": 1e-3, "params": []}),
                           args=SimpleNamespace(optim="galore_adamw", learning_rate=1e-3, weight_decay=0.0),
                           model=torch.nn.Linear(2, 2), lora_plus_ratio=4)
    with pytest.raises(UserError, match="^lora.plus_lr_ratio: train.optim galore_adamw builds its own parameter groups"):
        optimizer.lora_plus(stub)
    stub.accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config={"optimizer": {"type": "AdamW"}})))
    with pytest.raises(UserError, match="^lora.plus_lr_ratio: the DeepSpeed config has its own optimizer block"):
        optimizer.check_deepspeed(stub)
    stub.accelerator.state.deepspeed_plugin = None
    optimizer.check_deepspeed(stub)


# --- what peft 0.21.2 itself does (the refusals above rest on it) --------------------------------------------------

@pytest.mark.parametrize("setting, error", [
    ({"use_dora": True}, "does not work with use_dora=True"),  # ParamWrapper refuses DoRA
    ({"init_lora_weights": "pissa"}, "has no attribute 'weight'"),  # its init reads base_layer.weight
    ({"init_lora_weights": "olora"}, "has no attribute 'weight'"),
    ({"init_lora_weights": "orthogonal"}, "has no attribute 'weight'"),
    ({"init_lora_weights": "mica"}, "unsupported variant combination"),
])
def test_peft_refuses_these_on_the_fused_routed_experts(setting, error, tiny_moe_dir):
    """Pins peft 0.21.2: if this fails, peft changed what its ParamWrapper supports; revisit lora.check_variants."""
    from peft import get_peft_model

    model = moe(tiny_moe_dir)
    config = lora_config(model, LoraSection(r=R))
    for key, value in setting.items():
        setattr(config, key, value)
    with pytest.raises((ValueError, AttributeError), match=error), targets_as_written():
        get_peft_model(model, config)


def test_peft_refuses_pissa_on_a_4bit_base_and_dora_with_mica(tiny_own_dir):
    need_module("bitsandbytes", TEST_EXTRA)
    from peft import LoraConfig, get_peft_model

    with pytest.raises(TypeError, match="Please initialize PiSSA under float32"):
        get_peft_model(load_model(str(tiny_own_dir), "float32", "sdpa", load_in_4bit=True),
                       LoraConfig(r=R, target_modules=["q_proj"], init_lora_weights="pissa"))
    with pytest.raises(ValueError, match="unsupported variant combination"):
        get_peft_model(load_model(str(tiny_own_dir), "float32", "sdpa"),
                       LoraConfig(r=R, target_modules=["q_proj"], use_dora=True, init_lora_weights="mica"))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_adapters_without_dropout_skip_peft_input_casts_under_autocast_bit_for_bit(tiny_own_dir, dropout):
    """A bf16 base with fp32 adapters under bf16 autocast, as the LoRA recipes train: without dropout, skipping peft's
    input cast (and autocast's cast back) gives bit-identical logits and gradients with fewer copy kernels; with
    dropout the cast is kept (the layers are left as peft made them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from erniekit_lite.model.lora import skip_input_casts

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.ops.aten._to_copy.default
            return func(*args, **(kwargs or {}))

    def step(model):
        model.zero_grad(set_to_none=True)
        with Copies() as copies, torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=IDS).logits
            out.float().square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.detach(), grads, copies.count

    torch.manual_seed(0)
    model = apply_lora(load_model(str(tiny_own_dir), "bfloat16", "sdpa"), LoraSection(r=R, alpha=ALPHA, dropout=dropout))
    model.train()
    torch.manual_seed(1)
    before, grads_before, copies_before = step(model)
    changed = skip_input_casts(model)
    torch.manual_seed(1)  # the same dropout masks
    after, grads_after, copies_after = step(model)
    assert grads_before and grads_before.keys() == grads_after.keys()
    if dropout:
        assert changed == 0 and copies_after == copies_before
        return
    assert changed > 0 and copies_after < copies_before, (copies_after, copies_before)
    assert torch.equal(after, before)
    assert all(torch.equal(grads_after[k], grads_before[k]) for k in grads_before)
    with torch.no_grad():  # outside autocast the cast is peft's again: an fp32 adapter on a bf16 input still runs
        model(input_ids=IDS)
