"""LoRA on the ERNIE 4.5 MoE: every expert group gets adapters, the router none; adapters reload and merge exactly;
training moves every group, logs the router aux loss and writes the expert load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from erniekit_lite.cli import main
from erniekit_lite.errors import UserError
from erniekit_lite.model.load import load_model
from erniekit_lite.model.lora import apply_lora, group_of, trainable_groups
from erniekit_lite.recipe import DEFAULT_LORA_TARGETS, LoraSection
from helpers import shared_data, write_recipe

ROOT = Path(__file__).resolve().parents[1]
EVERY_GROUP = ("attention", "dense MLP", "shared experts", "routed experts")


def moe(tiny_moe_dir):
    return load_model(str(tiny_moe_dir), "float32", "sdpa")


def test_peft_alone_leaves_shared_experts_and_dense_mlp_without_adapters(tiny_moe_dir):
    """Pins the peft 0.21.2 behaviour that `targets_as_written` works around. If this fails, peft changed how it
    rewrites MoE targets: re-check erniekit_lite/model/lora.py before relying on either behaviour."""
    from peft import LoraConfig, get_peft_model

    plain = get_peft_model(moe(tiny_moe_dir), LoraConfig(r=4, target_modules=list(DEFAULT_LORA_TARGETS), task_type="CAUSAL_LM"))
    groups = trainable_groups(plain)
    assert groups["routed experts"] > 0
    assert groups["shared experts"] == 0 and groups["dense MLP"] == 0


def test_lora_reaches_every_group_and_never_the_router(tiny_moe_dir):
    model = apply_lora(moe(tiny_moe_dir), LoraSection(r=4))
    groups = trainable_groups(model)
    hidden, inter, shared, experts, r = 64, 64, 64, 8, 4  # dense layer: 32 x 2 shared x 1 kv head wide, as released
    kv = 32  # 2 kv heads x head_dim 16
    moe_inter = 32
    attention_per_layer = r * (hidden + hidden) + r * (hidden + kv) * 2 + r * (hidden + hidden)  # q, k, v, o
    assert groups["attention"] == 3 * attention_per_layer
    assert groups["dense MLP"] == r * (hidden + inter) * 3  # layer 0: gate, up, down
    assert groups["shared experts"] == 2 * r * (hidden + shared) * 3  # layers 1 and 2
    # per expert: rank 2r on the fused [gate; up] (hidden -> 2 x moe_inter) and rank r on down (moe_inter -> hidden)
    per_layer = experts * (2 * r) * (hidden + 2 * moe_inter) + experts * r * (moe_inter + hidden)
    assert groups["routed experts"] == 2 * per_layer
    assert groups["other"] == 0
    for name, param in model.named_parameters():
        if ".mlp.gate." in name:
            assert not param.requires_grad and "lora" not in name, name


def test_expert_r_sets_the_routed_experts_rank_alone_at_scale_alpha_over_it(tiny_moe_dir):
    """lora.expert_r: rank 2·expert_r on the fused [gate; up], expert_r on down, scale alpha / expert_r there (rsLoRA:
    alpha / sqrt(expert_r)); attention, the dense MLP and the shared experts keep r (their down_proj is not matched)."""
    hidden, moe_inter, experts = 64, 32, 8
    for rslora in (False, True):
        full = trainable_groups(apply_lora(moe(tiny_moe_dir), LoraSection(r=4, alpha=8, use_rslora=rslora)))
        model = apply_lora(moe(tiny_moe_dir), LoraSection(r=4, alpha=8, expert_r=2, use_rslora=rslora))
        groups = trainable_groups(model)
        assert {g: n for g, n in groups.items() if g != "routed experts"} == {g: n for g, n in full.items() if g != "routed experts"}
        assert groups["routed experts"] == 2 * (experts * 4 * (hidden + 2 * moe_inter) + experts * 2 * (moe_inter + hidden))
        scales = {name: module.scaling["default"] for name, module in model.named_modules()
                  if hasattr(module, "scaling") and ".layers.1.mlp." in name}
        expected = (lambda r: 8 / r ** 0.5) if rslora else (lambda r: 8 / r)
        assert scales["base_model.model.model.layers.1.mlp.shared_experts.down_proj"] == pytest.approx(expected(4))
        wrapped = [s for n, s in scales.items() if ".mlp.experts" in n]
        assert wrapped and all(s == pytest.approx(expected(2)) for s in wrapped), scales


def test_router_target_and_dropout_on_experts_are_refused(tiny_moe_dir):
    with pytest.raises(UserError, match="router"):
        apply_lora(moe(tiny_moe_dir), LoraSection(targets=["q_proj", "gate"]))
    with pytest.raises(UserError, match="lora.dropout"):
        apply_lora(moe(tiny_moe_dir), LoraSection(dropout=0.1))
    with pytest.raises(UserError, match="target both or neither"):
        apply_lora(moe(tiny_moe_dir), LoraSection(targets=["gate_proj", "down_proj"]))
    kept = trainable_groups(apply_lora(moe(tiny_moe_dir), LoraSection(dropout=0.1, routed_experts=False)))
    assert kept["routed experts"] == 0 and kept["shared experts"] > 0 and kept["dense MLP"] > 0


LOGITS_SCRIPT = """
import sys, torch
from erniekit_lite.model.load import load_model
model = load_model(sys.argv[1], "float32", "sdpa").eval()
with torch.no_grad():
    torch.save(model(input_ids=torch.load(sys.argv[2])).logits, sys.argv[3])
"""


@pytest.mark.parametrize("expert_r", [None, 2])
def test_adapter_reloads_in_a_fresh_process_and_merges_to_a_plain_checkpoint(expert_r, tmp_path, tiny_moe_dir):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from erniekit_lite.model.merge import merge

    model = apply_lora(moe(tiny_moe_dir), LoraSection(r=4, expert_r=expert_r)).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # B starts at zero; make every adapter matter
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    ids = torch.randint(5, 200, (2, 24))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        base = moe(tiny_moe_dir)(input_ids=ids).logits
    assert (expected - base).abs().max() > 1e-2
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    torch.save(ids, tmp_path / "ids.pt")

    subprocess.run([sys.executable, "-c", LOGITS_SCRIPT, str(adapter), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")], check=True)
    assert (torch.load(tmp_path / "out.pt") - expected).abs().max().item() <= 1e-6

    # peft's own loader rewrites the targets again and loses the shared/dense adapters (pinned, see lora.py)
    with torch.no_grad():
        plain = PeftModel.from_pretrained(moe(tiny_moe_dir), str(adapter)).eval()(input_ids=ids).logits
    assert (plain - expected).abs().max() > 1e-3

    merged_dir = merge(str(adapter), str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert not hasattr(merged, "peft_config")
    with torch.no_grad():
        assert (merged(input_ids=ids).logits - expected).abs().max().item() <= 1e-5
    with safe_open(str(merged_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in keys  # released per-expert layout
    assert not any("lora" in k or "gate_up_proj" in k for k in keys)
    with pytest.raises(UserError, match="not empty"):
        merge(str(adapter), str(merged_dir))


def moe_recipe(tmp_path: Path, model_dir, method="sft", **train) -> Path:
    train = {"learning_rate": 1e-2, "max_steps": 3, "per_device_train_batch_size": 2, "logging_steps": 1,
             "save_steps": 2, "activation_checkpointing": False, "seed": 0, **train}
    return write_recipe(tmp_path / "recipe.yaml", model_dir, method=method, data={"max_length": 256}, lora={"r": 4, "alpha": 8},
                        train=train)


def test_moe_lora_sft_moves_every_group_logs_aux_loss_and_writes_expert_load(tmp_path, capsys, tiny_moe_dir):
    from safetensors.torch import load_file

    code = main(["train", str(moe_recipe(tmp_path, tiny_moe_dir))])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "trainable by group: attention" in out and "router frozen, router aux loss coefficient 0.001" in out
    run = tmp_path / "out"
    adapters = load_file(run / "adapter_model.safetensors")
    for group in EVERY_GROUP:  # lora_B starts at zero: nonzero means this group's adapters were trained
        moved = [k for k, v in adapters.items() if "lora_B" in k and group_of(k) == group and v.abs().max() > 0]
        assert moved, f"no trained adapter in {group}"
    assert not any(".mlp.gate." in k for k in adapters)
    history = json.loads((run / "trainer_state.json").read_text())["log_history"]
    assert all(h["aux_loss"] > 0 for h in history if "loss" in h)

    load = json.loads((run / "expert_load.json").read_text())
    results = json.loads((run / "train_results.json").read_text())
    assert load["layers"] == [1, 2] and load["experts"] == 8 and load["top_k"] == 2
    assert load["routed_tokens"] == results["train_tokens"]  # every real training token routed once per layer
    for counts, share in zip(load["counts"], load["share"]):
        assert sum(counts) == 2 * results["train_tokens"]
        assert abs(sum(share) - 1) < 1e-9
    assert (run / "expert_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "checkpoint-2" / "adapter_model.safetensors").is_file()


def test_moe_lora_dpo_with_aux_loss_off(tmp_path, capsys, tiny_moe_dir):
    code = main(["train", str(moe_recipe(tmp_path, tiny_moe_dir, "dpo", max_steps=2, beta=0.1)), "train.router_aux_loss_coef=0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "router aux loss off" in out
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    assert not any("aux_loss" in h for h in history)
    assert "rewards/accuracies" in history[0]
    load = json.loads((tmp_path / "out" / "expert_load.json").read_text())
    assert sum(load["counts"][0]) > 0  # recorded from the policy passes even with the aux loss off


@pytest.fixture(scope="module")
def released_21b_dir(tmp_path_factory):
    """The 21B-A3B config with the real ERNIE 4.5 tokenizer: enough to plan a recipe without the weights."""
    import shutil

    from conftest import ERNIE_TOKENIZER_DIR, SHARED, SHARED_HOW, missing

    config = SHARED / "ernie45" / "ernie-4.5-21b-a3b-pt" / "config.json"
    if not config.is_file():
        missing(str(config), SHARED_HOW)
    out = tmp_path_factory.mktemp("ernie-21b-config")
    shutil.copy(config, out / "config.json")
    for name in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
        shutil.copy(ERNIE_TOKENIZER_DIR / name, out / name)
    return out


@pytest.mark.parametrize("name", ["sft-lora.yaml", "dpo-lora.yaml"])
def test_21b_lora_recipes_plan_every_expert(capsys, released_21b_dir, name):
    recipe = ROOT / "recipes" / "ernie-4.5-21b-a3b" / name
    code = main(["validate", str(recipe), f"model.path={released_21b_dir}", "train.bf16=false", *shared_data(recipe)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Ernie4_5_MoeForCausalLM" in out
    r, hidden, kv, inter, moe_inter, experts = 32, 2560, 512, 12288, 1536, 64
    attention = 28 * (r * (hidden + hidden) * 2 + r * (hidden + kv) * 2)
    dense = 3 * r * (hidden + inter)
    shared = 27 * 3 * r * (hidden + 2 * moe_inter)
    routed = 27 * experts * (2 * r * (hidden + 2 * moe_inter) + r * (moe_inter + hidden))
    assert f"{attention + dense + shared + routed:,} trainable (LoRA r=32)" in out
    assert f"trainable by group: attention {attention:,}, dense MLP {dense:,}, shared experts {shared:,}, routed experts {routed:,}" in out


def test_full_fine_tuning_trains_the_router_but_never_its_correction_bias(tmp_path, capsys, tiny_moe_dir):
    from safetensors.torch import load_file

    recipe = yaml.safe_load(moe_recipe(tmp_path, tiny_moe_dir).read_text())
    del recipe["lora"]
    recipe["train"].update(max_steps=2, learning_rate=1e-3)
    path = tmp_path / "full.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code = main(["train", str(path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "moe: router trained" in out
    before, after = load_file(tiny_moe_dir / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    bias = "model.layers.1.mlp.moe_statics.e_score_correction_bias"  # the released layout's name
    assert torch.equal(before[bias], after[bias])  # it only biases which experts are picked: no gradient reaches it
    # frozen at load (transformers 5.23 hands it back trainable): no optimizer state, no float32 trainable in bf16
    model = load_model(str(tiny_moe_dir), dtype="bfloat16")
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {f"model.layers.{i}.mlp.gate.moe_statics.e_score_correction_bias" for i in (1, 2)}
    assert not torch.equal(before["model.layers.1.mlp.gate.weight"], after["model.layers.1.mlp.gate.weight"])


def test_expert_load_counts_the_experts_the_model_routed_to(tiny_moe_dir):
    """Per-expert counts equal the top-k indices the MoE blocks actually handed their experts (captured by a hook),
    over real tokens only. The correction bias is set so that top-k without it picks other experts, and the batch is
    padded so that counting pads gives other totals: a wrong rule or a missing mask fails."""
    from erniekit_lite.model.load import load_model
    from erniekit_lite.train.expert_load import ExpertLoad

    model = load_model(str(tiny_moe_dir)).eval()
    torch.manual_seed(0)
    used, hooks = [], []
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            hooks.append(module.register_forward_hook(lambda m, args, out: used.append(args[1].clone())))
            gate = model.get_submodule(name.rsplit(".", 1)[0] + ".gate")
            with torch.no_grad():
                gate.moe_statics.e_score_correction_bias.normal_(0, 0.5)
    mask = torch.tensor([[1] * 12, [1] * 7 + [0] * 5])
    ids = torch.randint(3, model.config.vocab_size, mask.shape)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False)
    for h in hooks:
        h.remove()
    load = ExpertLoad(model)
    load.add(out.router_logits, mask)
    experts = model.config.moe_num_experts
    real = mask.reshape(-1).bool()
    expected = torch.stack([torch.bincount(chosen[real].reshape(-1), minlength=experts) for chosen in used])
    assert torch.equal(load.counts, expected)
    assert int(expected[0].sum()) == 19 * model.config.moe_k
    unbiased = torch.stack([
        torch.bincount(torch.topk(torch.softmax(logits.float(), -1), model.config.moe_k, -1).indices[real].reshape(-1), minlength=experts)
        for logits in out.router_logits
    ])
    assert not torch.equal(unbiased, expected)  # the bias changes the choice here
    with pytest.raises(ValueError, match="attention mask covers 12 tokens, the router logits 24"):
        ExpertLoad(model).add(out.router_logits, mask[:1])
