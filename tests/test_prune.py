"""`erniekit-lite prune`: tiny ERNIE 4.5 MoEs (3 layers, the first dense, 8 experts top-2, 2 shared; the real tokenizer)
with constructed routing.

The constructed model: every token embedding gets +10 on coordinate 0 and random values (sd 2) on coordinates 1-4,
so every router input holds about +7 on coordinate 0; a router row with +1 there gives its expert a logit near +7,
one with -1 (and zeros elsewhere) near -7. Experts with -1 are then never picked (their probability about e^-14 of a
kept one's), and which of the +1 experts a token picks is decided by their random weights on coordinates 1-4. Expected: exactly the +1 experts are kept, with a zero
bias no token's choice changes and the logits are the original's; with the dropped experts carrying probability but
pushed out of every top-k by their bias, choices change (measured, and counted independently)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import DATA_DIR, ERNIE_TOKENIZER_DIR, needs_engine
from helpers import IDENTITY, run_cli, write_recipe

KEPT = {1: [1, 2, 4, 6, 7], 2: [0, 3, 4, 5, 6]}  # decoder layer -> the experts routed to
EVAL = DATA_DIR / "erniekit" / "sft-eval.jsonl"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """torch on one thread for the module (as conftest's `one_thread`, for the module fixtures too): these tiny models
    ran 2-6x slower on two threads of a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_moe(out: Path, tokenizer_dir: Path) -> Path:
    from erniekit_lite.tiny import write_tiny

    return write_tiny(str(out), "moe", str(tokenizer_dir), hidden_size=64, layers=3)


def constructed(tmp: Path, base: Path, dropped_mass: bool = False, bias_seed: int | None = None) -> Path:
    """The tiny MoE with the routing above. `dropped_mass`: the dropped experts' rows get +1 too (they carry about 3/8
    of each token's probability) and a bias of -1 (never in a top-k); `bias_seed`: the kept experts' biases random
    in [-0.05, 0.05] (as released models have non-zero ones; else 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, 0] += 10.0
        embed[:, 1:5] = torch.randn(embed.shape[0], 4, generator=generator) * 2
        model.model.norm.weight[:5] = 0.0  # the (tied) LM head does not read them: logits of the usual size
        for index, kept in KEPT.items():
            gate = model.model.layers[index].mlp.gate
            dropped = [e for e in range(8) if e not in kept]
            gate.weight[dropped] = 0.0
            gate.weight[dropped, 0] = -1.0
            gate.weight[kept, 0] = 1.0
            gate.weight[kept, 1:5] = torch.randn(len(kept), 4, generator=generator)
            bias = gate.moe_statics.e_score_correction_bias
            bias.zero_()
            if dropped_mass:
                gate.weight[dropped, 0] = 1.0
                bias[0, dropped] = -1.0
            if bias_seed is not None:
                bias[0, kept] = torch.rand(len(kept), generator=torch.Generator().manual_seed(bias_seed + index)) * 0.1 - 0.05
    return save_with_tokenizer(model, base, tmp / "constructed")


def save_with_tokenizer(model, base: Path, out: Path) -> Path:
    """The model beside `base`'s tokenizer files, and the real sentencepiece `tokenizer.model` (llama.cpp's converter
    reads it; prune carries it over)."""
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (base / name).is_file():
            (out / name).write_bytes((base / name).read_bytes())
    (out / "tokenizer.model").write_bytes((ERNIE_TOKENIZER_DIR / "tokenizer.model").read_bytes())
    return out


def logits_of(model_dir: Path, ids: list[list[int]]) -> list[torch.Tensor]:
    """Each sample alone through plain transformers (no erniekit-lite code)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([i])).logits[0] for i in ids]


def samples(model_dir: Path, data: Path = IDENTITY) -> list[list[int]]:
    """The data's samples as training tokenizes them (the same tokens prune scores)."""
    from erniekit_lite.data.prepare import prepare
    from erniekit_lite.evaluate import resolve
    from erniekit_lite.model.load import load_tokenizer

    section = resolve(str(model_dir), str(data), None)[1]
    return [s.input_ids for s in prepare(section, load_tokenizer(str(model_dir)), log=lambda *_: None).train.samples]


def reference_routing(model_dir: Path, ids: list[list[int]], kept: dict[int, list[int]] | None = None):
    """Independently of prune.py, from the router logits transformers returns: per MoE layer, each expert's routing
    weight (softmax over all experts, + correction bias, top-k; the picked probabilities over their sum, summed over
    tokens), and with `kept` the tokens whose top-k over the kept experts alone holds an expert the original did not
    pick. Only the first MoE layer's count is comparable to prune's (deeper layers see the cut model's states)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    weight = {i: torch.zeros(8, dtype=torch.float64) for i in layers}
    changed = {i: 0 for i in layers}
    with torch.no_grad():
        for sample in ids:
            out = model(input_ids=torch.tensor([sample]), output_router_logits=True)
            for index, logits in zip(layers, out.router_logits):
                gate = model.model.layers[index].mlp.gate
                bias = gate.moe_statics.e_score_correction_bias[0]
                probs = torch.softmax(logits.float(), -1)
                chosen = torch.topk(probs + bias, gate.top_k, -1).indices
                picked = probs.gather(-1, chosen)
                weight[index].index_add_(0, chosen.reshape(-1), (picked / picked.sum(-1, keepdim=True)).reshape(-1).double())
                if kept is not None:
                    k = torch.tensor(kept[index])
                    after = k[torch.topk(torch.softmax(logits.float()[:, k], -1) + bias[k], gate.top_k, -1).indices]
                    changed[index] += int((after[:, :, None] != chosen[:, None, :]).all(-1).any(-1).sum())
    return weight, changed


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory, ernie_tokenizer_dir) -> Path:
    return tiny_moe(tmp_path_factory.mktemp("prune-tiny"), ernie_tokenizer_dir)


@pytest.fixture(scope="module")
def ids(tiny_base) -> list[list[int]]:
    """The identity demo's samples (every model here has the same tokenizer)."""
    return samples(tiny_base)


@pytest.fixture(scope="module")
def zero_bias(tmp_path_factory, tiny_base) -> Path:
    return constructed(tmp_path_factory.mktemp("prune-zero"), tiny_base)


@pytest.fixture(scope="module")
def zero_bias_pruned(tmp_path_factory, zero_bias) -> tuple[Path, str]:
    from erniekit_lite.cli import main

    out = tmp_path_factory.mktemp("prune-zero-out") / "pruned"
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["prune", str(zero_bias), "--experts", "5", "--data", str(IDENTITY), "--out", str(out),
                     "--report", "8,5,3", "--eval", str(EVAL)]) == 0
    return out, printed.getvalue()


def test_keeps_the_routed_experts_and_logits_equal_with_zero_bias(zero_bias, zero_bias_pruned, ids):
    out, printed = zero_bias_pruned
    marker = json.loads((out / "erniekit_pruned.json").read_text())
    assert {la["index"]: la["kept"] for la in marker["layers"]} == KEPT
    for la in marker["layers"]:
        assert la["share"] == pytest.approx(1.0, abs=1e-6)  # the dropped experts were never picked
        assert la["changed"] == 0 and la["tokens"] == marker["tokens"] > 0
        assert f"{la['index']:>5}  {'100.0%':>19}  0 of {la['tokens']:,} (0.0%)" in printed
    config = json.loads((out / "config.json").read_text())
    assert (config["moe_num_experts"], config["moe_k"], config["architectures"]) == (5, 2, ["Ernie4_5_MoeForCausalLM"])
    assert marker["parameters"] == marker["parameters_before"] - 2 * 3 * 3 * 64 * 32 - 2 * 3 * (64 + 1)  # experts, router rows, bias
    assert "bf16 size" in printed and f"{marker['parameters_before']:,} -> {marker['parameters']:,}" in printed

    for before, after in zip(logits_of(zero_bias, ids), logits_of(out, ids)):
        torch.testing.assert_close(after, before, atol=1e-5, rtol=0)

    # the kept experts' weights, bias and router rows are the original's, in order
    from safetensors.torch import load_file

    original, cut = load_file(zero_bias / "model.safetensors"), load_file(out / "model.safetensors")
    for index, kept in KEPT.items():
        prefix = f"model.layers.{index}.mlp."
        for new, old in enumerate(kept):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert torch.equal(cut[f"{prefix}experts.{new}.{proj}.weight"], original[f"{prefix}experts.{old}.{proj}.weight"])
        assert f"{prefix}experts.5.gate_proj.weight" not in cut
        assert torch.equal(cut[f"{prefix}gate.weight"], original[f"{prefix}gate.weight"][kept])
        assert torch.equal(cut[f"{prefix}moe_statics.e_score_correction_bias"], original[f"{prefix}moe_statics.e_score_correction_bias"][:, kept])


def test_report_tables_held_out_loss_by_size(zero_bias, zero_bias_pruned):
    """The original, and 8 (all kept), 5 (only never-picked experts dropped) and 3 experts: the first three score the
    same held-out loss; 3 drops routed experts and scores another."""
    out, printed = zero_bias_pruned
    report = (out.parent / "pruned.report.md").read_text()
    rows = [line.split(" | ") for line in report.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("| 3 (original)", "8"), ("| 3", "8"), ("| 3", "5"), ("| 3", "3")]
    losses = [float(r[-2]) for r in rows]
    assert losses[0] == losses[1] == losses[2] != losses[3]
    assert [r[-1] for r in rows[:3]] == ["+0.0000 |"] * 3
    assert rows[2][5] == "100.0% / 100.0%" and rows[2][6] == "0.0%"  # 5 kept: every routed expert
    assert float(rows[3][5].split("%")[0]) < 100
    assert (out.parent / "pruned.report.png").stat().st_size > 0
    marker = json.loads((out / "erniekit_pruned.json").read_text())
    assert [r["experts"] for r in marker["report"]["rows"]] == [8, 8, 5, 3]
    assert f"wrote {out.parent / 'pruned.report.md'}" in printed


def test_a_prune_that_fails_while_writing_its_report_leaves_the_earlier_one_whole(zero_bias, zero_bias_pruned, tmp_path, monkeypatch):
    """The report is staged with the model: a failure while drawing the plot (a stand-in: savefig raising) leaves the
    earlier prune's model and report as they were, and nothing staged beside them (the report was written in place
    before, the new table beside the old model)."""
    import shutil

    import matplotlib.figure

    from erniekit_lite.cli import main

    earlier, _ = zero_bias_pruned
    out = tmp_path / "pruned"
    shutil.copytree(earlier, out)
    for ext in (".md", ".png"):
        shutil.copy(earlier.parent / f"pruned.report{ext}", tmp_path / f"pruned.report{ext}")
    before = {p.name: p.read_bytes() for p in [*out.iterdir(), *tmp_path.glob("pruned.report.*")] if p.is_file()}

    def fails(*args, **kwargs):
        raise RuntimeError("stand-in: the plot could not be written")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", fails)
    with pytest.raises(RuntimeError, match="stand-in"):
        main(["prune", str(zero_bias), "--experts", "3", "--data", str(IDENTITY), "--out", str(out), "--overwrite",
              "--report", "8,3", "--eval", str(EVAL)])
    assert {p.name: p.read_bytes() for p in [*out.iterdir(), *tmp_path.glob("pruned.report.*")] if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pruned", "pruned.report.md", "pruned.report.png"]


def test_report_says_no_change_as_plus_zero():
    """A cut that scores the original's loss up to the last bits (an 8-expert model pruned to all 8: the same sums in
    another order; seen as -0.0000 on an AMD EPYC) reads +0.0000; a change shows its sign."""
    from erniekit_lite.prune import report_markdown

    row = {"layers": 3, "top_k": 2, "parameters": 1000, "share_min": 1.0, "share_mean": 1.0, "changed": 0.0}
    losses = [5.123456789, 5.123456789 - 1e-12, 5.123456789 + 1e-12, 5.123456789 - 0.25]
    table = {"tokens": 10, "rows": [{**row, "experts": 8, "original": i == 0, "loss": loss} for i, loss in enumerate(losses)]}
    changes = [line.rsplit(" | ", 2)[-1] for line in report_markdown(table, "m").splitlines() if line.startswith("| 3")]
    assert changes == ["+0.0000 |", "+0.0000 |", "+0.0000 |", "-0.2500 |"]


def test_written_model_loads_generates_and_chats(capsys, zero_bias, zero_bias_pruned):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = zero_bias_pruned
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Ernie4_5_MoeForCausalLM" and model.model.layers[1].mlp.experts.gate_up_proj.shape[0] == 5
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (out / "tokenizer.model").read_bytes() == (zero_bias / "tokenizer.model").read_bytes()
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(zero_bias).chat_template
    generated = model.generate(torch.tensor([[1, 563, 600]]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert generated.shape == (1, 9)
    code, _, err = run_cli(capsys, "chat", out, "--prompt", "Who are you?", "--max-new-tokens", "4")
    assert code == 0, err
    from erniekit_lite.serve import serve_command

    command, name = serve_command(str(out), "transformers", "127.0.0.1", 8000, None)
    assert name == str(out) and str(out) in command


def test_cut_in_place_matches_a_model_built_for_k_experts_and_is_undone(zero_bias):
    """Every size the cut model's modules hold (expert counts, top-k, parameter shapes) is what transformers builds
    from the cut config, so `--report` and the check pass run what the written model runs; leaving restores the model."""
    from transformers import AutoModelForCausalLM

    from erniekit_lite.prune import Layer, Result, pruned

    model = AutoModelForCausalLM.from_pretrained(zero_bias)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def sizes(m):
        ints = {name: {k: v for k, v in vars(mod).items() if type(v) is int} for name, mod in m.named_modules()}
        return ints, {k: tuple(v.shape) for k, v in m.state_dict().items()}

    result = Result(5, 1, [Layer(i, kept, 1.0) for i, kept in KEPT.items()], 0)
    with pruned(model, result):
        assert (model.config.moe_num_experts, model.config.moe_k) == (5, 1)
        assert sizes(model) == sizes(AutoModelForCausalLM.from_config(model.config))
    assert (model.config.moe_num_experts, model.config.moe_k) == (8, 2)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("bias_seed", [None, 1])
def test_bias_moves_choices_when_dropped_experts_carried_probability(tmp_path, capsys, tiny_base, ids, bias_seed):
    """Dropped experts that carried 3/8 of the probability but never made a top-k (bias -1): the kept experts'
    probabilities grow by 1/(kept mass), and (with kept biases random in [-0.05, 0.05]) the bias weighs relatively
    less, so some tokens pick another pair. With a zero bias on the kept experts the choice cannot change (the
    ranking is the same over larger probabilities). Prune's count in the first MoE layer equals the independent one."""
    model_dir = constructed(tmp_path, tiny_base, dropped_mass=True, bias_seed=bias_seed)
    out = tmp_path / "pruned"
    code, _, err = run_cli(capsys, "prune", model_dir, "--experts", "5", "--data", IDENTITY, "--out", out)
    assert code == 0, err
    marker = json.loads((out / "erniekit_pruned.json").read_text())
    assert {la["index"]: la["kept"] for la in marker["layers"]} == KEPT
    _, changed = reference_routing(model_dir, ids, KEPT)
    first = marker["layers"][0]
    assert first["changed"] == changed[first["index"]]
    diff = max(float((a - b).abs().max()) for a, b in zip(logits_of(model_dir, ids), logits_of(out, ids)))
    counts = {la["index"]: f"{la['changed']} of {la['tokens']}" for la in marker["layers"]}
    print(f"kept biases {'random, seed ' + str(bias_seed) if bias_seed else 'zero'}: tokens picking a new expert per layer "
          f"{counts}; largest logit difference {diff:.3g}")
    if bias_seed is None:
        assert all(la["changed"] == 0 for la in marker["layers"]) and diff < 1e-5
    else:
        assert all(la["changed"] > 0 for la in marker["layers"]) and diff > 1e-4


def test_keeps_the_experts_of_most_routing_weight_with_random_biases(tmp_path, capsys, tiny_base, ids):
    """An unconstructed random tiny MoE with random non-zero biases (as released models have), cut to 3 experts at
    top-1: the kept experts are the 3 of most routing weight by the independent count, with their share."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_base)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.moe_statics.e_score_correction_bias.copy_(torch.rand(1, 8, generator=generator) * 0.1)
    save_with_tokenizer(model, tiny_base, tmp_path / "biased")
    out = tmp_path / "pruned"
    code, _, err = run_cli(capsys, "prune", tmp_path / "biased", "--experts", "3", "--top-k", "1", "--data", IDENTITY, "--out", out)
    assert code == 0, err
    marker = json.loads((out / "erniekit_pruned.json").read_text())
    weight, _ = reference_routing(tmp_path / "biased", ids)
    for la in marker["layers"]:
        w = weight[la["index"]]
        expected = sorted(torch.argsort(w, descending=True)[:3].tolist())
        assert la["kept"] == expected
        assert la["share"] == pytest.approx(float(w[expected].sum() / w.sum()), rel=1e-6)
        assert la["changed"] > 0  # top-1 of 3: tokens that picked a dropped expert pick a kept one now
    config = json.loads((out / "config.json").read_text())
    assert (config["moe_num_experts"], config["moe_k"]) == (3, 1)
    print(f"random biases, 3 of 8 experts at top-1: {[(la['index'], la['kept'], round(la['share'], 3), la['changed'], la['tokens']) for la in marker['layers']]}")


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    """A dense ERNIE 4.5 config (all prune reads before refusing)."""
    from erniekit_lite.tiny import tiny_config

    out = tmp_path_factory.mktemp("prune-dense")
    tiny_config("dense", 1024, 64, 2).save_pretrained(out)
    return out


@pytest.mark.parametrize("args, says", [
    (["--experts", "0"], "--experts 0: must be from 2 (the experts each token picks) to 8 (moe_num_experts)"),
    (["--experts", "9"], "--experts 9: must be from 2"),
    (["--experts", "1"], "--experts 1: below top-k 2 (moe_k)"),
    (["--experts", "2", "--top-k", "3"], "--experts 2: below top-k 3 (--top-k)"),
    (["--experts", "4", "--top-k", "0"], "--top-k 0: each token must pick at least 1 expert"),
    (["--experts", "4", "--report", "4,x"], "--report 4,x: expected layers=, experts=, top-k= followed by numbers"),
    (["--experts", "4", "--report", "experts=4,x"], "--report experts=4,x: expected numbers separated by commas"),
    (["--experts", "4", "--report", "6,1"], "--report experts=1: below top-k 2"),
    (["--experts", "4", "--report", "experts=6 top-k=9"], "--report top-k=9: must be from 1 to 8"),
    (["--experts", "4", "--report", "layers=3 depth=2"], "--report depth=2: expected layers=, experts=, top-k= followed by numbers"),
    (["--experts", "4", "--report", "layers=0"], "--report layers=0: must be from 1 to 3"),
    (["--experts", "4", "--report", "6"], "--report: needs held-out data: --eval FILE"),
    (["--experts", "4", "--batch-size", "0"], "--batch-size must be at least 1"),
])
def test_bad_arguments_are_one_line(tmp_path, capsys, zero_bias, args, says):
    code, _, err = run_cli(capsys, "prune", zero_bias, "--data", IDENTITY, "--out", tmp_path / "out", *args)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and says in err, err
    assert not (tmp_path / "out").exists()


def test_refusals_are_one_line(tmp_path, capsys, zero_bias, zero_bias_pruned, dense_dir):
    out, _ = zero_bias_pruned
    cases = [
        (["prune", zero_bias, "--experts", "4", "--out", tmp_path / "a"], f"--data: {zero_bias} is a model, not a run"),
        (["prune", dense_dir, "--experts", "4", "--data", IDENTITY, "--out", tmp_path / "a"],
         "an ernie4_5 model has no routed experts to prune; --experts takes an ERNIE 4.5 MoE (ernie4_5_moe), and --layers cuts a dense model too"),
        (["prune", zero_bias, "--experts", "4", "--data", IDENTITY, "--out", out], f"{out}: not empty; choose a new --out, or --overwrite"),
        (["prune", zero_bias, "--experts", "4", "--data", IDENTITY, "--out", dense_dir, "--overwrite"], "not a previous prune"),
        (["prune", tmp_path / "nope", "--experts", "4", "--data", IDENTITY, "--out", tmp_path / "a"], "no such directory"),
    ]
    for argv, says in cases:
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and err.count("\n") == 1 and says in err, err
    assert (dense_dir / "config.json").is_file() and json.loads((out / "config.json").read_text())["moe_num_experts"] == 5


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_base) -> Path:
    """A LoRA run (every expert adapted, B drawn large so the merge shows) on the tiny MoE, 10% held out."""
    from helpers import make_adapter_visible

    from erniekit_lite.cli import main

    tmp = tmp_path_factory.mktemp("prune-lora")
    recipe = write_recipe(tmp / "r.yaml", tiny_base, lora={"r": 4, "alpha": 8}, out=tmp / "run", data={"eval_split": 0.2},
                          train={"learning_rate": 1e-2, "max_steps": 1, "per_device_train_batch_size": 2, "activation_checkpointing": False})
    assert main(["train", str(recipe)]) == 0
    return make_adapter_visible(tmp / "run")


@pytest.mark.slow
def test_lora_run_is_merged_and_measured_on_its_training_data(tmp_path, capsys, lora_run, ids):
    """All 8 experts kept: the pruned run is the merged run (logits equal); the run's own training data is measured
    and its held-out split reported."""
    out = tmp_path / "all"
    code, _, err = run_cli(capsys, "prune", lora_run, "--experts", "8", "--out", out, "--report", "8,4,2")
    assert code == 0, err
    marker = json.loads((out / "erniekit_pruned.json").read_text())
    assert marker["data"] == [str(IDENTITY)] and all(la["share"] == 1.0 and la["changed"] == 0 for la in marker["layers"])
    assert run_cli(capsys, "merge", lora_run, "--out", tmp_path / "merged")[0] == 0
    for before, after in zip(logits_of(tmp_path / "merged", ids), logits_of(out, ids)):
        torch.testing.assert_close(after, before, atol=1e-5, rtol=0)
    report = (tmp_path / "all.report.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[1] for r in rows] == ["8", "8", "4", "2"] and rows[0].startswith("| 3 (original) |")
    assert rows[0].split(" | ")[-2] == rows[1].split(" | ")[-2]  # all kept: the original's held-out loss
    assert (tmp_path / "all.report.png").stat().st_size > 0
    assert [r["experts"] for r in marker["report"]["rows"]] == [8, 8, 4, 2]
    code, _, err = run_cli(capsys, "prune", lora_run, "--experts", "4", "--out", tmp_path / "again", "--report", "4",
                           "--data", IDENTITY)
    assert code == 2 and "--report: needs held-out data" in err  # the run's held-out split is not held out from --data


@pytest.mark.slow
def test_new_lora_run_starts_from_the_pruned_model(tmp_path, capsys, zero_bias_pruned):
    from erniekit_lite.cli import main

    out, _ = zero_bias_pruned
    recipe = write_recipe(tmp_path / "r.yaml", out, lora={"r": 4, "alpha": 8}, out=tmp_path / "run",
                          train={"learning_rate": 1e-2, "max_steps": 2, "per_device_train_batch_size": 2, "activation_checkpointing": False})
    assert main(["train", str(recipe)]) == 0
    from safetensors import safe_open

    with safe_open(tmp_path / "run" / "adapter_model.safetensors", "pt") as f:
        names = f.keys()
        shapes = {k: f.get_slice(k).get_shape() for k in names if "layers.1.mlp.experts" in k and "lora_A" in k}
    assert shapes and all(shape[0] % 5 == 0 and shape[0] // 5 in (4, 8) for shape in shapes.values()), shapes  # E·r rows
    assert (tmp_path / "run" / "train_results.json").is_file()


LLAMA_CPP = __import__("os").environ.get("LLAMA_CPP_DIR")


@pytest.mark.slow
@needs_engine(lambda: LLAMA_CPP and __import__("importlib").util.find_spec("llama_cpp") is not None,
              "llama-cpp-python and llama.cpp's converter (LLAMA_CPP_DIR)", "build llama-cpp-python from its sdist and set LLAMA_CPP_DIR")
def test_export_gguf_of_the_pruned_model_answers_as_transformers(tmp_path, capsys, zero_bias_pruned):
    assert_gguf_answers_as_transformers(tmp_path, capsys, zero_bias_pruned[0])


def assert_gguf_answers_as_transformers(tmp_path: Path, capsys, out: Path) -> None:
    """`export --to gguf` (f32) of `out` answers greedily in llama.cpp as transformers does."""
    from helpers import in_child
    from test_export_gguf import AGREEMENT, ENGINE, PROMPTS

    code, _, err = run_cli(capsys, "export", out, "--outtype", "f32", "--out", tmp_path / "gguf", "--llama-cpp", LLAMA_CPP)
    assert code == 0, err
    gguf = tmp_path / "gguf" / json.loads((tmp_path / "gguf" / "erniekit_export.json").read_text())["gguf"]
    prompts, expected = AGREEMENT.transformers_greedy(out, PROMPTS, 12)
    from transformers import AutoTokenizer

    from erniekit_lite.export import STOP

    tokenizer = AutoTokenizer.from_pretrained(out)
    stop = sorted(tokenizer.convert_tokens_to_ids(t) for t in STOP)
    assert in_child(ENGINE, "greedy", str(gguf), prompts, stop, 12) == expected
    assert sum(map(len, expected)) >= 3 * len(PROMPTS)


# ---------------------------------------------------------------- --layers (elastic depth)

def with_identity_layer(base: Path, out: Path, layer: int) -> Path:
    """`base` with decoder layer `layer` an exact identity: the outputs it adds to the residual stream (attention's
    o_proj, the MLP's down projections, shared and routed) are zero."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    block = model.model.layers[layer]
    with torch.no_grad():
        block.self_attn.o_proj.weight.zero_()
        mlp = block.mlp
        for name in ("down_proj", "experts.down_proj", "shared_experts.down_proj"):
            target = mlp
            for part in name.split("."):
                target = getattr(target, part, None)
            if isinstance(target, torch.nn.Linear):
                target.weight.zero_()
            elif isinstance(target, torch.Tensor):
                target.zero_()
    return save_with_tokenizer(model, base, out)


def loud_experts(base: Path, out: Path, layer: int) -> Path:
    """`base` with layer `layer`'s routed experts' outputs 100x: a random tiny model's experts move its loss by about
    1e-6, too little to tell a cut that drops routed experts from one that does not."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        model.model.layers[layer].mlp.experts.down_proj.mul_(100)
    return save_with_tokenizer(model, base, out)


GRID = {"dense": "layers=3,2,1", "moe": "layers=3,2 experts=5,3 top-k=2,1"}


@pytest.fixture(scope="module", params=["dense", "moe"])
def depth_cut(request, tmp_path_factory, ernie_tokenizer_dir, zero_bias) -> tuple[str, Path, Path, int]:
    """(arch, the model, its cut, the identity layer): 3 decoder layers, one an exact identity (dense: the middle one
    of a random tiny model; MoE: the last, an MoE layer, of the constructed zero-bias model, so `--experts 5` drops
    only experts no token picks), cut with `--layers 2` (MoE: and `--experts 5`) and a `--report` grid."""
    from erniekit_lite.cli import main
    from erniekit_lite.tiny import write_tiny

    arch, tmp = request.param, tmp_path_factory.mktemp(f"prune-depth-{request.param}")
    if arch == "dense":
        base, identity, experts = Path(write_tiny(str(tmp / "base"), arch, str(ernie_tokenizer_dir), hidden_size=64, layers=3)), 1, []
    else:
        base, identity, experts = loud_experts(zero_bias, tmp / "loud", 1), 2, ["--experts", "5"]
    model_dir = with_identity_layer(base, tmp / "model", identity)
    assert main(["prune", str(model_dir), "--layers", "2", *experts, "--data", str(IDENTITY), "--out", str(tmp / "cut"),
                 "--report", GRID[arch], "--eval", str(EVAL)]) == 0
    return arch, model_dir, tmp / "cut", identity


def test_layers_drops_an_identity_layer_and_keeps_the_logits(tmp_path, capsys, depth_cut, ids):
    """`--layers 2` drops the identity layer (influence 0, up to rounding), the logits of plain transformers equal the
    original's (fp32, 1e-5), greedy generation is the same, the MoE config still places its MoE layer
    (moe_layer_start/end_index renumbered; 5 experts), and a LoRA run starts from the cut model."""
    arch, model_dir, cut, identity = depth_cut
    marker = json.loads((cut / "erniekit_pruned.json").read_text())
    assert marker["layers_kept"] == [i for i in range(3) if i != identity]
    # 1 - cos of a vector with itself: 0 up to float rounding
    assert marker["influence"][identity] < 1e-6 < min(marker["influence"][i] for i in marker["layers_kept"])
    config = json.loads((cut / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    if arch == "moe":
        assert (config["moe_layer_start_index"], config["moe_layer_end_index"], config["moe_num_experts"]) == (1, 1, 5)
        assert [la["index"] for la in marker["layers"]] == [1] and marker["layers"][0]["kept"] == KEPT[1]  # the MoE layer kept
    for before, after in zip(logits_of(model_dir, ids[:3]), logits_of(cut, ids[:3])):
        torch.testing.assert_close(after, before, atol=1e-5, rtol=0)
    from transformers import AutoModelForCausalLM

    prompt = torch.tensor([ids[0][:12]])
    generated = [AutoModelForCausalLM.from_pretrained(d).eval().generate(prompt, max_new_tokens=6, do_sample=False)
                 for d in (model_dir, cut)]
    assert torch.equal(*generated)
    recipe = write_recipe(tmp_path / "r.yaml", cut, lora={"r": 4}, out=tmp_path / "run",
                          train={"max_steps": 1, "per_device_train_batch_size": 2, "activation_checkpointing": False})
    assert run_cli(capsys, "train", recipe)[0] == 0 and (tmp_path / "run" / "adapter_model.safetensors").is_file()


def test_report_grid_over_depth_experts_and_top_k(tmp_path, capsys, depth_cut):
    """The grid's points, largest first, after the original: the cuts that drop only the identity layer and experts
    no token picks score the original's held-out loss (1e-5: fp32 logits, a loss of 11.5), the others another (by more
    than 5e-5); the point the written model is has its parameter count and the held-out loss `eval` gives it (1e-5);
    the table and the plot are written."""
    arch, model_dir, cut, _ = depth_cut
    rows = json.loads((cut / "erniekit_pruned.json").read_text())["report"]["rows"]
    points = [(r["layers"], r["experts"], r["top_k"]) for r in rows]
    loss = {p: r["loss"] for p, r in zip(points, rows)}
    if arch == "dense":
        assert points == [(3, None, None), (3, None, None), (2, None, None), (1, None, None)]
        same, written = [(3, None, None), (2, None, None)], (2, None, None)
    else:
        assert points == [(3, 8, 2), *[(n, e, k) for n in (3, 2) for e in (5, 3) for k in (2, 1)]]
        same, written = [(3, 5, 2), (2, 5, 2)], (2, 5, 2)
    original = rows[0]["loss"]
    assert all(r["loss"] == pytest.approx(original, abs=1e-5) for r in rows[1:] if (r["layers"], r["experts"], r["top_k"]) in same)
    # measured: MoE 2e-4 (top-1) and 6e-4 (3 experts); dense 5e-3 (1 layer)
    assert all(abs(r["loss"] - original) > 5e-5 for r in rows[1:] if (r["layers"], r["experts"], r["top_k"]) not in same)
    marker = json.loads((cut / "erniekit_pruned.json").read_text())
    assert rows[1 + points[1:].index(written)]["parameters"] == marker["parameters"] < rows[0]["parameters"]
    assert run_cli(capsys, "eval", cut, "--data", EVAL, "--out", tmp_path / "eval.json")[0] == 0
    assert json.loads((tmp_path / "eval.json").read_text())["eval_loss"] == pytest.approx(loss[written], abs=1e-5)
    table = (cut.parent / "cut.report.md").read_text().splitlines()
    assert table[2].startswith("| layers | " + ("experts per layer | top-k | " if arch == "moe" else "parameters"))
    assert [line.split(" | ")[0] for line in table[4:]] == ["| 3 (original)"] + [f"| {p[0]}" for p in points[1:]]
    assert (cut.parent / "cut.report.png").stat().st_size > 0


@pytest.mark.slow
@needs_engine(lambda: LLAMA_CPP and __import__("importlib").util.find_spec("llama_cpp") is not None,
              "llama-cpp-python and llama.cpp's converter (LLAMA_CPP_DIR)", "build llama-cpp-python from its sdist and set LLAMA_CPP_DIR")
def test_export_gguf_of_the_depth_cut_model_answers_as_transformers(tmp_path, capsys, depth_cut):
    """llama.cpp places MoE layers by the leading dense block count (moe_layer_start_index) and the step
    (moe_layer_interval): the renumbered cut says both."""
    _, _, cut, _ = depth_cut
    assert_gguf_answers_as_transformers(tmp_path, capsys, cut)


def test_a_cut_the_config_cannot_place_is_refused_in_one_line():
    """transformers makes layer i MoE when (i + 1) % interval == 0 and start <= i <= end: kept layers whose kinds
    that cannot say (a dense layer after an MoE one) are refused; those it can get their new start and end."""
    from types import SimpleNamespace

    from erniekit_lite.errors import UserError
    from erniekit_lite.prune import moe_placement

    every_other = SimpleNamespace(moe_layer_interval=2, moe_layer_start_index=1, moe_layer_end_index=3)  # 1 and 3 MoE
    assert moe_placement(every_other, [0, 1]) == (1, 1) and moe_placement(every_other, [1, 3]) == (0, 1)
    assert moe_placement(every_other, [0, 2]) == (2, 1)  # no MoE layer left: an empty range
    with pytest.raises(UserError, match=r"^--layers 2: the layers kept \(1, 2\) put the dense layer 2 after an MoE layer"):
        moe_placement(every_other, [1, 2])
    assert moe_placement(SimpleNamespace(), [0, 1]) is None  # dense


def test_layers_bad_arguments_are_one_line(tmp_path, capsys, dense_dir, zero_bias):
    cases = [
        ([dense_dir, "--layers", "2"], "--layers 2: must be from 1 to 1 (the model has 2 decoder layers)"),
        ([dense_dir], "prune: give --experts K (routed experts kept per MoE layer), --layers L (decoder layers kept), or both"),
        ([dense_dir, "--layers", "1", "--report", "layers=2 experts=4"], "--report experts=4: an ernie4_5 model has no routed experts; its grid is layers=..."),
        ([dense_dir, "--layers", "1", "--report", "4"], "--report experts=4: an ernie4_5 model has no routed experts"),
        ([zero_bias, "--layers", "2", "--report", "layers=2 layers=1"], "--report layers=1: layers given twice"),
    ]
    for argv, says in cases:
        code, _, err = run_cli(capsys, "prune", *argv, "--data", IDENTITY, "--out", tmp_path / "out")
        assert code == 2 and err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "out").exists()
