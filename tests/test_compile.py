"""`train.torch_compile` (TrainingArguments' own key) through erniekit-lite's trainer: packed rows, LoRA, the
scoring forward. Compiled with `aot_eager` (dynamo's graph capture and AOTAutograd's joint graph, without
inductor's C++ code generation, which takes minutes on 2 cores) the losses equal the eager run's."""

from __future__ import annotations

import functools
import json

import pytest

from erniekit_lite.cli import main
from test_cli import recipe_file  # tests/ is on sys.path under pytest


def _losses(run) -> list[float]:
    return [h["loss"] for h in json.loads((run / "trainer_state.json").read_text())["log_history"] if "loss" in h]


def test_torch_compile_gives_the_eager_losses(tmp_path, capsys, tiny_own_dir, one_thread):
    common = ["train.max_steps=3", "train.logging_steps=1", "train.save_strategy=no", "output.sample_prompts=[]"]
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["train.torch_compile=true", "train.torch_compile_backend=aot_eager"])):
        (tmp_path / name).mkdir()
        recipe = recipe_file(tmp_path / name, tiny_own_dir, lora={"r": 4, "alpha": 8})
        assert main(["train", str(recipe), *common, *extra]) == 0, capsys.readouterr().err
        runs[name] = _losses(tmp_path / name / "out")
    assert len(runs["eager"]) == 3
    assert runs["compiled"] == pytest.approx(runs["eager"], rel=1e-5)


def _packed_batches(tokenizer, n: int, seed: int = 0):
    import random

    from erniekit_lite.data.collate import PackedCollator
    from erniekit_lite.data.formats import Conversation, Turn
    from erniekit_lite.data.packing import pack
    from erniekit_lite.data.template import template_for
    from erniekit_lite.data.tokenize import Tokenizer
    from erniekit_lite.model.attention import take_batch_lengths

    rng = random.Random(seed)
    for i in range(n):
        convs = [Conversation([Turn(f"Q{i}{j}: " + "word " * rng.randint(1, 20), "Answer " * rng.randint(1, 9))]) for j in range(5)]
        samples, _ = Tokenizer(tokenizer, template_for(tokenizer))(convs, max_length=512)
        batch = PackedCollator(512)([vars(r) for r in pack(samples, 512)])
        for key in ("token_slots", "real_tokens"):
            batch.pop(key)
        yield take_batch_lengths(batch), batch.pop("labels")  # as the trainer hands the batch to the model


@pytest.mark.slow  # ~25 s: dynamo traces the step seven times
def test_a_compiled_packed_lora_step_breaks_only_where_it_must(tiny_dense_dir, ernie_tokenizer, one_thread):
    """Graph breaks of a packed LoRA step (`torch._dynamo.explain`): per-sample attention runs eagerly, once per
    layer (a loop over data-dependent bounds), and the frozen LM head's backward hooks; the positions to score come
    from the collator (a data-dependent count before), and the LM head's underflow branch and the bounds read (both
    breaks before) are gone. New sample lengths compile nothing new once the shapes went dynamic (traced, the
    per-sample loop compiled a graph for every new set of lengths)."""
    import torch
    from torch._dynamo.utils import counters

    from erniekit_lite.model.load import load_model
    from erniekit_lite.model.lora import apply_lora
    from erniekit_lite.recipe import LoraSection
    from erniekit_lite.train import scored

    model = apply_lora(load_model(str(tiny_dense_dir), "float32", "packed_sdpa"), LoraSection(r=4, dropout=0.0))
    scored.take(model.get_base_model())

    def step(batch, labels):
        scores = model(**batch, score_labels=labels)
        return -scores.log_probs.sum() / scores.log_probs.numel()

    batches = list(_packed_batches(ernie_tokenizer, 6))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(*batches[0])
    reasons = [b.reason.splitlines()[0] for b in explained.break_reasons]
    layers = model.config.num_hidden_layers
    skipped = "Attempted to inline function marked as skipped"
    assert sorted(set(reasons)) == [skipped, "Skip calling `torch.compiler.disable()`d function"]
    assert reasons.count(skipped) == 1  # the frozen LM head's saved-tensor hooks (scoring._head_chunks)
    assert all(b.user_stack[-1].filename.endswith("modeling_ernie4_5.py") for b in explained.break_reasons if not b.reason.startswith(skipped))
    assert len(reasons) == 1 + 2 * layers  # the head's, and attention's as dynamo reports it from each decoder layer's frame

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="eager")
    graphs = []
    for batch, labels in batches:
        compiled(batch, labels).backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[2:] == [graphs[2]] * (len(batches) - 2), graphs


@functools.cache  # an op is registered once per process
def _varlen_stand_in():
    """A CPU stand-in for PyTorch's CUDA `varlen_attn`: a custom op (opaque to dynamo, as the kernel is) with its
    signature, running per-sample sdpa inside. It stands in for the kernel only in what dynamo sees."""
    import torch

    @torch.library.custom_op("erniekit_test::varlen_attn", mutates_args=(), schema="(Tensor q, Tensor k, Tensor v, Tensor cu, float scale) -> Tensor")
    def varlen(q, k, v, cu, scale):
        lengths = (cu[1:] - cu[:-1]).tolist()
        return torch.cat([torch.nn.functional.scaled_dot_product_attention(
            a.transpose(0, 1), b.transpose(0, 1), c.transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
            for a, b, c in zip(q.split(lengths), k.split(lengths), v.split(lengths))])

    varlen.register_fake(lambda q, k, v, cu, scale: torch.empty_like(q))

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), scale=None, enable_gqa=False):
        return varlen(query, key, value, cu_seq_q, scale if scale is not None else query.shape[-1] ** -0.5)

    return varlen_attn


def test_a_compiled_layer_runs_varlen_attention_without_a_break_or_a_recompile(tiny_own_dir, monkeypatch, one_thread):
    """`model.compile_layers` with `packed_varlen` (bf16): no graph break in the decoder layers, one compiled graph set
    for every layer and 5 packed rows of different shapes (no recompile after the first), the eager model's hidden
    states."""
    import random

    import torch
    from torch._dynamo.utils import counters

    from erniekit_lite.data.collate import PackedCollator
    from erniekit_lite.model import attention, compile_layers
    from erniekit_lite.model.load import load_model

    kernel = _varlen_stand_in()  # registered here, not while dynamo traces the first call
    monkeypatch.setattr(attention, "varlen_kernel", lambda: kernel)
    eager = load_model(str(tiny_own_dir), "bfloat16", "packed_varlen")
    compiled = load_model(str(tiny_own_dir), "bfloat16", "packed_varlen")
    assert compile_layers.compile_layers(compiled, "eager") == 2
    torch._dynamo.reset()
    counters.clear()
    rng, graphs = random.Random(0), []
    for _ in range(5):
        lengths = [rng.randint(3, 40) for _ in range(rng.randint(1, 4))]
        rows = [{"input_ids": [rng.randrange(eager.config.vocab_size) for _ in range(sum(lengths))], "labels": [1] * sum(lengths), "seq_lengths": lengths}]
        batch = PackedCollator(256)(rows)
        inputs = {k: batch[k] for k in ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
        with torch.no_grad():
            want = eager.model(**attention.take_batch_lengths({**inputs, "sample_lengths": batch["sample_lengths"]})).last_hidden_state
            got = compiled.model(**attention.take_batch_lengths({**inputs, "sample_lengths": batch["sample_lengths"]})).last_hidden_state
        assert torch.equal(got, want)
        graphs.append(counters["stats"]["unique_graphs"])
    assert dict(counters["graph_break"]) == {}
    assert graphs == [graphs[0]] * 5, graphs


@pytest.mark.parametrize("arch, lora, checkpointing", [("dense", True, False), ("dense", False, True), ("moe", True, False)],
                         ids=["dense-lora", "dense-full-checkpointing", "moe-lora"])
def test_compiled_layers_give_the_eager_losses(tmp_path, capsys, tiny_own_dir, tiny_moe_dir, one_thread, arch, lora, checkpointing):
    """3 steps in fp32 through `aot_eager` (dynamo and AOTAutograd without inductor's code generation, minutes on 2
    cores): the losses equal eager's within 1e-5. The MoE's split expert LoRA runs eagerly inside its layer."""
    common = ["train.max_steps=3", "train.logging_steps=1", "train.save_strategy=no", "output.sample_prompts=[]",
              f"train.activation_checkpointing={str(checkpointing).lower()}"]
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["model.compile_layers=true", "train.torch_compile_backend=aot_eager"])):
        (tmp_path / name).mkdir()
        recipe = recipe_file(tmp_path / name, tiny_own_dir if arch == "dense" else tiny_moe_dir, lora={"r": 4, "alpha": 8} if lora else None)
        assert main(["train", str(recipe), *common, *extra]) == 0, capsys.readouterr().err
        runs[name] = _losses(tmp_path / name / "out")
        assert ("compile: each decoder layer through torch.compile (backend aot_eager" in capsys.readouterr().out) == (name == "compiled")
    assert len(runs["eager"]) == 3
    assert runs["compiled"] == pytest.approx(runs["eager"], rel=1e-5)


def test_validate_says_whether_layers_compile_and_refuses_two_compilers(tmp_path, capsys, tiny_own_dir):
    recipe = recipe_file(tmp_path, tiny_own_dir, lora={"r": 4})
    assert main(["validate", str(recipe)]) == 0
    assert "compile: off (model.compile_layers; off by default until a GPU measurement shows compiled layers faster)" in capsys.readouterr().out
    assert main(["validate", str(recipe), "model.compile_layers=true"]) == 0
    assert "compile: each decoder layer through torch.compile (backend inductor" in capsys.readouterr().out
    assert main(["validate", str(recipe), "model.compile_layers=true", "train.torch_compile=true"]) != 0
    assert "model.compile_layers: train.torch_compile compiles the whole model as well; choose one" in capsys.readouterr().err


@pytest.mark.parametrize("lora", [False, True], ids=["full", "split-expert-lora"])
def test_compiled_moe_layers_keep_the_experts_outside_and_never_recompile(tiny_moe_dir, one_thread, lora):
    """The MoE's split expert LoRA counts tokens per expert (data-dependent sizes): compiled layers call it eagerly,
    as they do per-sample sdpa, so the only breaks are those two and 5 row shapes (forward and backward) compile
    nothing after the first. Traced instead, the routing recompiled the layer (25 graphs, then 28)."""
    import random

    import torch
    from torch._dynamo.utils import counters

    from erniekit_lite.data.collate import PackedCollator
    from erniekit_lite.model import attention, compile_layers
    from erniekit_lite.model.load import load_model
    from erniekit_lite.model.lora import apply_lora
    from erniekit_lite.recipe import LoraSection

    model = load_model(str(tiny_moe_dir), "float32", "packed_sdpa")
    if lora:
        model = apply_lora(model, LoraSection(r=4, dropout=0.0))
    compile_layers.compile_layers(model, "eager")
    torch._dynamo.reset()
    counters.clear()
    rng, graphs = random.Random(0), []
    for _ in range(5):
        lengths = [rng.randint(3, 30) for _ in range(rng.randint(1, 4))]
        rows = [{"input_ids": [rng.randrange(model.config.vocab_size) for _ in range(sum(lengths))], "labels": [1] * sum(lengths),
                 "seq_lengths": lengths}]
        batch = PackedCollator(128)(rows)
        keys = ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "sample_lengths")
        model(**attention.take_batch_lengths({k: batch[k] for k in keys})).logits.square().mean().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert {reason.splitlines()[0] for reason in counters["graph_break"]} == {"Skip calling `torch.compiler.disable()`d function"}
    assert graphs == [graphs[0]] * 5, graphs
