"""Split expert LoRA (model/expert_lora.py) computes what peft's merged path computes, with the same adapters.

"Equal" here: the largest absolute difference is at most 1e-5 x the largest absolute value of the merged path's
tensor (logits, or each adapter gradient), in fp32. lora_B is set random: peft starts it at zero, which would hide
a wrong B layout or scale.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from erniekit_lite.model.expert_lora import MERGED, SPLIT, SplitExperts, forget_layouts, layout_holders, set_expert_compute
from erniekit_lite.model.load import load_model
from erniekit_lite.model.lora import apply_lora, lora_config, targets_as_written
from erniekit_lite.recipe import LoraSection
from conftest import SHARED, SHARED_HOW, needs

RTOL = 1e-5


def random_b(model, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def adapted(model_dir, **lora):
    model = apply_lora(load_model(str(model_dir), "float32", "sdpa"), LoraSection(**lora))
    random_b(model)
    return model


def batch(vocab: int, rows: int = 2, length: int = 40, seed: int = 0) -> dict:
    ids = torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def run(model, mode: str, inputs: dict):
    """Logits and every adapter gradient of one forward and backward with the experts' adapters computed `mode`."""
    set_expert_compute(model, mode)
    model.zero_grad()
    out = model(**inputs)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_close(got, want, what: str = "") -> None:
    assert want.abs().max() > 0, what
    diff = (got - want).abs().max().item()
    assert diff <= RTOL * want.abs().max().item(), f"{what}: differs by {diff} (largest value {want.abs().max().item()})"


def assert_same_step(model, inputs, looped: bool = False, monkeypatch=None) -> None:
    merged_logits, merged_grads = run(model, MERGED, inputs)
    if looped:  # the loop over the experts hit, which runs where torch's grouped_mm cannot
        monkeypatch.setattr("erniekit_lite.model.grouped.can_group", lambda *args: False)
    logits, grads = run(model, SPLIT, inputs)
    assert_close(logits, merged_logits, "logits")
    assert grads.keys() == merged_grads.keys()
    assert any(".experts." in n for n in grads)
    for name, grad in grads.items():
        assert_close(grad, merged_grads[name], name)


def experts_of(model):
    return [m for n, m in model.named_modules() if n.endswith("mlp.experts")]


@pytest.mark.parametrize("lora, looped", [(dict(r=4), False), (dict(r=4), True), (dict(r=3, alpha=7, use_rslora=True), False)],
                         ids=["grouped", "looped", "rslora-r3-unaligned"])
def test_split_equals_merged(tiny_moe_dir, one_thread, monkeypatch, lora, looped):
    """Logits and every adapter gradient; r 3 (rank 6 on the fused gate_up) is not 16-byte aligned in fp32, so torch's
    grouped_mm cannot run and the loop does."""
    model = adapted(tiny_moe_dir, **lora)
    assert {type(m) for m in experts_of(model)} == {SplitExperts}  # the default
    assert_same_step(model, batch(model.config.vocab_size), looped, monkeypatch)


def test_split_equals_merged_with_a_rank_pattern(tiny_moe_dir, one_thread):
    """Any peft adapter: one layer's routed experts at their own rank and alpha (peft's rank_pattern/alpha_pattern)."""
    from peft import get_peft_model

    model = load_model(str(tiny_moe_dir), "float32", "sdpa")
    config = lora_config(model, LoraSection(r=4, use_rslora=True))
    config.rank_pattern[r"model\.layers\.2\.mlp\.experts\.down_proj"] = 8
    config.alpha_pattern[r"model\.layers\.2\.mlp\.experts\.down_proj"] = 5
    with targets_as_written():
        model = get_peft_model(model, config)
    random_b(model)
    down = {n: m for n, m in model.named_modules() if n.endswith("mlp.experts")}
    down = {n.split(".layers.")[1][0]: m for n, m in down.items()}
    assert down["1"].r["default"] == 4 and down["2"].r["default"] == 8 and down["2"].scaling["default"] == 5 / 8 ** 0.5
    assert set_expert_compute(model, SPLIT) == 2
    assert_same_step(model, batch(model.config.vocab_size))


def test_packed_rows_split_equals_merged(tiny_moe_dir, one_thread):
    """A packed row (position_ids restarting per sample): the same as merged, and each sample as if alone."""
    from erniekit_lite.data.collate import PackedCollator

    model = apply_lora(load_model(str(tiny_moe_dir), "float32", "packed_sdpa"), LoraSection(r=4))
    random_b(model)
    ids = batch(model.config.vocab_size, rows=1, length=60)["input_ids"][0].tolist()
    inputs = PackedCollator(64)([{"input_ids": ids, "labels": ids, "seq_lengths": [25, 35]}])
    inputs.pop("token_slots")
    assert_same_step(model, inputs)
    with torch.no_grad():
        packed = model(**inputs).logits[0]
        second = model(input_ids=torch.tensor([ids[25:]])).logits[0]
    assert_close(packed[25:], second, "second sample alone")


class Shapes(TorchDispatchMode):
    """The shapes of every tensor the ops run under it compute (views of existing tensors left out)."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in [] if func.is_view else out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(value, torch.Tensor):
                self.seen.add(tuple(value.shape))
        return out


def test_split_computes_no_gradient_for_the_frozen_expert_weights(tiny_moe_dir, one_thread):
    """Backward makes no tensor shaped like an expert stack (merged makes one per weight and layer: the gradient of
    W + s·B·A), and the frozen stacks get no .grad."""
    model = adapted(tiny_moe_dir, r=4)
    base = experts_of(model)[0].get_base_layer()
    stacks = {tuple(w.shape) for w in (base.gate_up_proj, base.down_proj)}
    stacks |= {(e, i, o) for e, o, i in stacks}
    for mode, expected in ((MERGED, True), (SPLIT, False)):
        set_expert_compute(model, mode)
        loss = model(**batch(model.config.vocab_size)).loss
        with Shapes() as backward:
            loss.backward()
        assert bool(backward.seen & stacks) is expected, mode
    for name, param in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert not param.requires_grad and param.grad is None, name


def test_adapter_saved_from_either_path_loads_in_the_other(tmp_path, tiny_moe_dir, one_thread):
    """Trained a step and saved with one path, loaded (erniekit's loader: split) and run with the other: same logits."""
    inputs = batch(load_model(str(tiny_moe_dir)).config.vocab_size, rows=1)
    for made, loaded in ((SPLIT, MERGED), (MERGED, SPLIT)):
        model = adapted(tiny_moe_dir, r=4, expert_compute=made)
        assert {type(m).__name__ for m in experts_of(model)} == {"SplitExperts" if made == SPLIT else "ParamWrapper"}
        model(**inputs).loss.backward()
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param -= 0.5 * param.grad
            want = model(input_ids=inputs["input_ids"]).logits
        model.save_pretrained(tmp_path / made)
        again = load_model(str(tmp_path / made), "float32", "sdpa")
        assert {type(m) for m in experts_of(again)} == {SplitExperts}
        set_expert_compute(again, loaded)
        with torch.no_grad():
            assert_close(again(input_ids=inputs["input_ids"]).logits, want, f"{made} -> {loaded}")


def test_disabled_adapters_run_the_base(tiny_moe_dir):
    """DPO's and KTO's reference is the policy with its adapters disabled: peft's own path, the plain base."""
    model = adapted(tiny_moe_dir, r=4)
    ids = batch(model.config.vocab_size)["input_ids"]
    with torch.no_grad():
        base = model.get_base_model()
        with model.disable_adapter():
            reference = model(input_ids=ids).logits
        assert not torch.allclose(model(input_ids=ids).logits, reference)  # the random B changes the model
        plain = load_model(str(tiny_moe_dir), "float32", "sdpa")(input_ids=ids).logits
    assert isinstance(base.model.layers[1].mlp.experts, SplitExperts)
    assert torch.equal(reference, plain)


def test_recipe_key_and_trainer_built_adapters(tiny_moe_dir):
    """`lora.expert_compute` is validated; adapters that TRL's GRPO trainer adds itself follow it too (a stand-in
    trainer here, doing what TRL does with a peft_config)."""
    from peft import get_peft_model
    from pydantic import ValidationError

    from erniekit_lite.train.grpo import trl_trainer

    with pytest.raises(ValidationError, match="expert_compute"):
        LoraSection(expert_compute="fused")

    class Trainer:  # what TRL does with a peft_config
        def __init__(self, model, peft_config):
            self.model = get_peft_model(model, peft_config)

    for mode, kind in ((SPLIT, "SplitExperts"), (MERGED, "ParamWrapper")):
        plan = SimpleNamespace(lora=LoraSection(r=4, expert_compute=mode))  # the run plan's field
        trainer = trl_trainer(Trainer, load_model(str(tiny_moe_dir), "float32", "sdpa"), plan)
        assert {type(m).__name__ for m in experts_of(trainer.model)} == {kind}


def released_moe(vocab: int = 1024):
    """The released 21B-A3B widths (64 experts top-6, hidden 2560, moe_intermediate 1536) with 2 layers: the dense
    first layer and one MoE layer; vocabulary cut to `vocab`. Random weights, fp32 (3.4 GB)."""
    from transformers import AutoModelForCausalLM, Ernie4_5_MoeConfig

    config = Ernie4_5_MoeConfig.from_pretrained(SHARED / "ernie45" / "ernie-4.5-21b-a3b-pt")
    config.update(dict(vocab_size=vocab, num_hidden_layers=2, moe_layer_end_index=1, use_cache=False))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.slow
@needs((SHARED / "ernie45" / "ernie-4.5-21b-a3b-pt").is_dir(), "the shared 21B-A3B config", SHARED_HOW)
def test_split_equals_merged_at_the_released_widths():
    model = apply_lora(released_moe(), LoraSection(r=8, alpha=16))
    random_b(model)
    assert experts_of(model)[0].get_base_layer().gate_up_proj.shape == (64, 3072, 2560)
    assert_same_step(model, batch(1024, rows=1, length=128))


def test_experts_without_tokens_get_no_gradient_and_a_layer_may_get_no_tokens(tiny_moe_dir, one_thread):
    """Tokens routed to experts 0 and 1 only: every other expert's A rows and B columns get a gradient of exactly 0,
    the two used ones a nonzero one; a call with no tokens at all (a micro-batch whose tokens all went elsewhere)
    returns [0, hidden] and backpropagates."""
    model = adapted(tiny_moe_dir, r=4)
    set_expert_compute(model, SPLIT)
    wrapper = next(m for m in model.modules() if isinstance(m, SplitExperts))
    chain, experts = wrapper_parts(wrapper)
    n, hidden = experts.num_experts, model.config.hidden_size
    x = torch.randn(6, hidden, requires_grad=True, generator=torch.Generator().manual_seed(0))
    index = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1], [1, 0]])
    wrapper(x, index, torch.full((6, 2), 0.5)).square().sum().backward()
    for param in chain:
        a, b = param.lora_A["default"].weight.grad, param.lora_B["default"].weight.grad
        r = a.shape[0] // n  # gate_up's adapter has rank 2r (peft's layout: docs/methods.md)
        for e in range(n):
            rows, columns = a[e * r:(e + 1) * r], b[:, [j * n + e for j in range(r)]]
            used = e in (0, 1)
            assert (rows.abs().max() > 0) == used and (columns.abs().max() > 0) == used, (param.parameter_name, e)
    empty = torch.zeros(0, hidden, requires_grad=True)
    out = wrapper(empty, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, hidden)
    out.sum().backward()
    assert empty.grad.shape == (0, hidden)


def wrapper_parts(outer):
    from erniekit_lite.model.expert_lora import wrappers

    chain, experts = wrappers(outer)
    return list(chain.values()), experts


def test_an_unaligned_rank_is_padded_and_grouped_not_looped(tiny_moe_dir, one_thread, monkeypatch):
    """Rank 3 in fp32 (12-byte rows): zero rows pad A and B to rank 4, so grouped_mm runs (the loop over the experts
    read the offsets back) and the result still equals the merged path."""
    from erniekit_lite.model import grouped

    model = adapted(tiny_moe_dir, r=3, alpha=7, use_rslora=True)
    seen, can_group = [], grouped.can_group
    monkeypatch.setattr(grouped, "can_group", lambda x, w: seen.append(can_group(x, w)) or seen[-1])
    assert_same_step(model, batch(model.config.vocab_size))
    assert seen and all(seen)


def test_the_laid_out_factors_follow_every_optimizer_step(tiny_moe_dir, one_thread):
    """Split keeps each expert adapter's B (and A, when cast to bf16 experts) laid out from one optimizer step to the
    next. After each of two steps of torch's fused AdamW (which updates the parameters without moving their version
    counter), each over two accumulated micro-batches, and after an in-place edit: the logits equal those with the
    kept layouts dropped (exactly), and in fp32 the merged path's on the same weights. A loop of its own: it calls
    `forget_layouts` after each step, as the project's Trainer does (tests/test_moe_lora.py trains through that)."""
    for dtype in ("float32", "bfloat16"):
        model = apply_lora(load_model(str(tiny_moe_dir), dtype, "sdpa"), LoraSection(r=4))
        random_b(model)
        wrappers = [m for m in model.modules() if isinstance(m, SplitExperts)]
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=True)
        inputs = [batch(model.config.vocab_size, rows=1, seed=seed) for seed in range(4)]
        probe = batch(model.config.vocab_size, rows=1, seed=9)["input_ids"]

        def check(when):
            with torch.no_grad():
                kept = model(input_ids=probe).logits
                for wrapper in wrappers:
                    for inner in wrapper_parts(wrapper)[0]:
                        inner.__dict__.get("laid_out", {}).clear()
                assert torch.equal(model(input_ids=probe).logits, kept), (dtype, when)
                if dtype == "float32":
                    set_expert_compute(model, MERGED)
                    assert_close(kept, model(input_ids=probe).logits, when)
                    set_expert_compute(model, SPLIT)

        for step in range(2):
            for micro in inputs[2 * step:2 * step + 2]:
                model(**micro).loss.backward()
            optimizer.step()
            forget_layouts(layout_holders(model))
            optimizer.zero_grad()
            check(f"after step {step + 1}")
        with torch.no_grad():
            next(p for n, p in model.named_parameters() if "experts" in n and ".lora_B." in n).mul_(3)
        check("after an in-place edit")


def test_the_trainer_drops_the_kept_layouts_after_every_optimizer_step(tiny_moe_dir, tmp_path, one_thread):
    """Through the project's Trainer base (`step.ErnieTrainer`, over a plain transformers Trainer) with torch's fused
    AdamW: at the start of each of 3 steps the layouts kept from the step before are exactly what laying the updated
    weights out anew gives."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from erniekit_lite.train.step import ErnieTrainer

    model = apply_lora(load_model(str(tiny_moe_dir), "float32", "sdpa"), LoraSection(r=4, dropout=0.0))
    probe, fresh = batch(model.config.vocab_size, rows=1, seed=9)["input_ids"], []

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            with torch.no_grad():
                kept = model(input_ids=probe).logits
                forget_layouts(layout_holders(model))
                fresh.append(torch.equal(model(input_ids=probe).logits, kept))

    class Plain(ErnieTrainer, Trainer):
        pass

    rows = [{k: v[0] for k, v in batch(model.config.vocab_size, rows=1, seed=s).items()} for s in range(3)]
    args = TrainingArguments(str(tmp_path), max_steps=3, per_device_train_batch_size=1, learning_rate=1e-2, report_to=[],
                             optim="adamw_torch_fused", save_strategy="no", use_cpu=True, disable_tqdm=True)
    Plain(model=model, args=args, train_dataset=rows, callbacks=[Probe()]).train()
    assert fresh == [True, True, True]
