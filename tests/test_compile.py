"""`train.torch_compile` (TrainingArguments' own key) through erniekit-lite's trainer: packed rows, LoRA, the
scoring forward. Compiled with `aot_eager` (dynamo's graph capture and AOTAutograd's joint graph, without
inductor's C++ code generation, which takes minutes on 2 cores) the losses equal the eager run's."""

from __future__ import annotations

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
    from erniekit_lite.train.scoring import add_scoring_forward

    model = apply_lora(load_model(str(tiny_dense_dir), "float32", "packed_sdpa"), LoraSection(r=4, dropout=0.0))
    add_scoring_forward(model.get_base_model())

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
