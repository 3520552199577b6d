"""ERNIE-4.5-VL training through the CLI (issue 64), in the spirit of the quick start: a tiny VL model trained briefly on
solid-colour pictures answers each picture's own colour through `chat --image`; LoRA trains the text model only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import TEST_EXTRA, needs, optional

from erniekit_lite.cli import main

RECIPES = Path(__file__).resolve().parents[1] / "erniekit_lite" / "recipes"
COLOURS = RECIPES / "data" / "colours"
QUESTION = "What colour is this picture?"


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> Path:
    from erniekit_lite.tiny import write_tiny

    return write_tiny(str(tmp_path_factory.mktemp("tiny-vl")), "vl")  # what `tiny --arch vl` writes


def train(tmp_path, model: Path, out: Path, *overrides: str) -> dict:
    code = main(["train", str(RECIPES / "quickstart-vl.yaml"), f"model.path={model}", f"output.dir={out}",
                 f"data.train.0.path={RECIPES / 'data' / 'colours.jsonl'}", *overrides])
    assert code == 0
    return json.loads((out / "trainer_state.json").read_text())


def ask(capsys, run: Path, colour: str) -> str:
    capsys.readouterr()
    assert main(["chat", str(run), "--image", str(COLOURS / f"{colour}.png"), "--prompt", QUESTION, "--max-new-tokens", "8"]) == 0
    return capsys.readouterr().out.strip()


def test_the_vl_quick_start_learns_each_pictures_colour(tmp_path, capsys, tiny_vl):
    """The shipped recipe as it is (60 steps, full fine-tuning, packed rows of about 3 samples) on the tiny VL model: the
    same question on the red and the blue picture gets each picture's own answer, from the saved run in a new load."""
    state = train(tmp_path, tiny_vl, tmp_path / "run", "output.expert_load=true")
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert losses[-1] < 0.2 * losses[0], losses
    # expert load per router: each MoE layer's text and vision routers count their own tokens; 60 steps over the 3
    # rows are 20 passes over every sample, so the vision routers' share of the routed tokens is the data's
    from transformers import AutoTokenizer

    from erniekit_lite.data import vl
    from erniekit_lite.model.vl import image_processor

    load = json.loads((tmp_path / "run" / "expert_load.json").read_text())
    assert load["layers"] == [1, 1, 2, 2, 3, 3] and load["routers"] == ["text", "vision"] * 3 and load["top_k"] == 2
    template = vl.VLTemplate(AutoTokenizer.from_pretrained(tiny_vl), image_processor(str(tiny_vl)))
    records = [json.loads(line) for line in (RECIPES / "data" / "colours.jsonl").read_text().splitlines()]
    samples = [s for r in records for s in template.samples(vl.messages_of(r, RECIPES / "data", "x"), "x")]
    vision, tokens = sum(sum(s.routing_types) for s in samples), sum(len(s) for s in samples)
    for text_row, vision_row in zip(load["counts"][0::2], load["counts"][1::2]):
        assert sum(vision_row) == 20 * 2 * vision and sum(text_row) + sum(vision_row) == 20 * 2 * tokens
    assert (tmp_path / "run" / "preprocessor_config.json").is_file()  # chat finds the image processor in the run
    # full fine-tuning leaves the vision encoder and resampler as they were (model.train_vision: false, the default)
    import torch

    from erniekit_lite.model.load import load_model

    before, after = (dict(load_model(str(p), "float32", "sdpa").named_parameters()) for p in (tiny_vl, tmp_path / "run"))
    vision = [n for n in before if n.startswith(("model.vision_tower.", "model.resampler_model."))]
    assert vision and all(torch.equal(before[n], after[n]) for n in vision)
    assert not torch.equal(before["model.language_model.layers.0.self_attn.q_proj.weight"], after["model.language_model.layers.0.self_attn.q_proj.weight"])
    assert ask(capsys, tmp_path / "run", "red") == "It is red."
    assert ask(capsys, tmp_path / "run", "blue") == "It is blue."


def test_vl_lora_trains_the_text_model_and_leaves_the_vision_encoder_alone(tmp_path, capsys, tiny_vl):
    """LoRA's default targets on the VL model: adapters on the text layers only (none in the vision encoder or the
    resampler); the run's adapter dir answers through chat, its base and image processor found from it; `merge`
    writes a VL checkpoint that answers the same."""
    from safetensors.torch import load_file

    train(tmp_path, tiny_vl, tmp_path / "lora", "lora.r=8", "lora.alpha=16", "train.max_steps=20", "train.learning_rate=1e-2")
    names = list(load_file(tmp_path / "lora" / "adapter_model.safetensors"))
    assert names and all(".language_model." in n for n in names), names
    assert not any(part in n for n in names for part in ("vision_tower", "resampler_model"))
    said = ask(capsys, tmp_path / "lora", "green")
    assert said  # an answer (20 steps do not teach it the colours)
    # merged: a checkpoint transformers loads as the VL model, with the image processor, that answers the same
    assert main(["merge", str(tmp_path / "lora"), "--out", str(tmp_path / "merged")]) == 0
    assert "loads with AutoModelForImageTextToText.from_pretrained" in capsys.readouterr().out
    assert ask(capsys, tmp_path / "merged", "green") == said


def test_a_vl_run_refuses_what_it_cannot_train_and_chat_refuses_images_for_a_text_model(tmp_path, capsys, tiny_vl, tiny_own_dir):
    """`validate` reads the image-text data as `train` does; a method VL runs do not take yet is one line; so are
    an image for a text model, a GGUF export and the transformers serve engine for a VL model."""
    code = main(["validate", str(RECIPES / "quickstart-vl.yaml"), f"model.path={tiny_vl}", f"output.dir={tmp_path / 'v'}",
                 f"data.train.0.path={RECIPES / 'data' / 'colours.jsonl'}"])
    out = capsys.readouterr().out
    assert code == 0 and "colours.jsonl [vl messages]: 8 records -> 8 samples" in out and "8 samples in 3 rows" in out, out
    assert "images: 4 to 16 tokens an image at the image processor's pixel budget (3,136 to 12,544 pixels)" in out, out
    for method, data, unit in (("sft", "colours.jsonl", "sample"), ("dpo", "colours_dpo.jsonl", "pair")):  # a held-out share
        code = main(["validate", str(RECIPES / "quickstart-vl.yaml"), f"model.path={tiny_vl}", f"output.dir={tmp_path / 'v'}",
                     f"data.train.0.path={RECIPES / 'data' / data}", "data.eval_split=0.25", f"method={method}", "lora.r=4"])
        out = capsys.readouterr().out
        assert code == 0 and f"train: 6 {unit}s in" in out and f"eval: 2 {unit}s in" in out, out
    code = main(["train", str(RECIPES / "quickstart-vl.yaml"), f"model.path={tiny_vl}", f"output.dir={tmp_path / 'orpo'}",
                 "method=orpo"])
    assert code == 2 and "method: orpo: not available for ERNIE-4.5-VL here; VL runs take sft, dpo" in capsys.readouterr().err
    code = main(["validate", str(RECIPES / "quickstart-vl.yaml"), f"model.path={tiny_vl}", "model.train_vision=true", "lora.r=8"])
    assert code == 2 and "model.train_vision: full fine-tuning of an ERNIE-4.5-VL model only (with lora:, lora.vision: true)" in capsys.readouterr().err
    code = main(["chat", str(tiny_own_dir), "--image", str(COLOURS / "red.png"), "--prompt", QUESTION])
    assert code == 2 and "--image: this model reads text only" in capsys.readouterr().err
    assert main(["export", str(tiny_vl), "--to", "gguf", "--out", str(tmp_path / "gguf")]) == 2
    assert "an ERNIE-4.5-VL model; llama.cpp's GGUF converter has no ERNIE-4.5-VL architecture" in capsys.readouterr().err
    assert main(["serve", str(tiny_vl), "--engine", "transformers"]) == 2
    assert "serve's transformers engine does not take VL models here: use --engine vllm" in capsys.readouterr().err


@needs(optional("bitsandbytes") is not None, "bitsandbytes", TEST_EXTRA)
def test_vl_qlora_quantizes_the_text_model_and_keeps_the_vision_encoder(tmp_path, tiny_vl):
    """QLoRA on the VL model: the text layers' Linears in NF4 and every MoE layer's text and vision routed experts
    4-bit (the 21B-A3B's 4-bit experts), the vision encoder and resampler in the model's dtype; ten steps train with
    adapters on the text and vision experts."""
    import torch

    from erniekit_lite.model.expert_4bit import is_4bit
    from erniekit_lite.model.load import load_model

    model = load_model(str(tiny_vl), "bfloat16", "sdpa", load_in_4bit=True)
    assert sum(is_4bit(m) for m in model.modules()) == 2 * 3  # (text, vision) x 3 MoE layers
    assert type(model.model.language_model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    assert all(type(m) is torch.nn.Linear for n, m in model.named_modules() if n.startswith(("model.vision_tower.", "model.resampler_model."))
               and isinstance(m, torch.nn.Linear))
    state = train(tmp_path, tiny_vl, tmp_path / "qlora", "lora.r=8", "model.load_in_4bit=true", "model.dtype=bfloat16", "train.max_steps=10",
                  "train.logging_steps=5")
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses) == 2 and all(l == l for l in losses)  # finite: no NaN from the 4-bit path


def test_vl_dpo_on_image_pairs_learns_the_right_colour(tmp_path, tiny_vl):
    """DPO LoRA on the shipped image pairs (`colours_dpo.jsonl`: each picture's colour chosen, another rejected; both
    record forms) from the tiny VL base: packed rows of whole pairs, the reference the base with the adapter disabled;
    over the last 10 of 20 steps the policy prefers the right colour on most pairs (measured 0.92 of them), by a margin
    that grew."""
    state = train(tmp_path, tiny_vl, tmp_path / "dpo", "method=dpo", f"data.train.0.path={RECIPES / 'data' / 'colours_dpo.jsonl'}",
                  "lora.r=8", "train.max_steps=20", "train.learning_rate=5e-3", "train.logging_steps=10")
    logged = [h for h in state["log_history"] if "rewards/accuracies" in h]
    assert logged[-1]["rewards/accuracies"] >= 0.75 and logged[-1]["loss"] < logged[0]["loss"] < 0.7, logged
    assert logged[-1]["rewards/margins"] > logged[0]["rewards/margins"] > 0, logged


@pytest.mark.slow  # ~30 s: six 29B-parameter models built on the meta device
def test_the_vl_recipes_memory_table_is_what_validate_prints(tmp_path, tiny_vl):
    """docs/vl.md's table: each figure is `validate`'s estimate for that shipped recipe (to 0.1 GiB) with the released
    VL-28B-A3B configuration (transformers' Ernie4_5_VLMoeConfig defaults) and the tiny VL model's tokenizer and image
    processor (the demo data read as training reads it)."""
    import re
    import shutil

    from transformers import Ernie4_5_VLMoeConfig

    from erniekit_lite import recipe as recipes
    from erniekit_lite.plan import plan

    released = tmp_path / "released"
    shutil.copytree(tiny_vl, released, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    Ernie4_5_VLMoeConfig(architectures=["Ernie4_5_VLMoeForConditionalGeneration"]).save_pretrained(released)
    text = (Path(__file__).resolve().parents[1] / "docs" / "vl.md").read_text(encoding="utf-8")
    table = text[text.index("| recipe | estimate | fits |"):].split("\n\n")[0].splitlines()[2:]
    rows = [re.match(r"\| `([^`]+)` \| ([\d.]+) GiB \| (.+) \|", row).groups() for row in table]
    assert len(rows) == 6
    for name, stated, fits in rows:
        recipe = recipes.load(str(RECIPES / f"{name}.yaml"), [f"model.path={released}", f"output.dir={tmp_path / 'out'}"])
        lines = []
        plan(recipe, log=lines.append)
        printed = next(x for x in lines if x.startswith("memory per device (estimate): "))
        assert printed.split(": ")[1].startswith(f"{stated} GiB for ") and printed.endswith(f"fits {fits}"), (name, printed)


def test_vl_router_losses_cover_the_text_and_the_vision_routers(tmp_path, tiny_vl):
    """`train.router_z_loss_coef` and `train.router_orthogonal_loss_coef` on the VL model: the z-loss over each token's
    own router's logits, the orthogonal loss over both routers of every MoE layer (text and vision: 6 here), whose
    value at step 0 is the formula's over the saved base's router weights."""
    from erniekit_lite.model.load import load_model
    from erniekit_lite.train.router_losses import orthogonal_loss, routers

    state = train(tmp_path, tiny_vl, tmp_path / "router", "train.router_z_loss_coef=0.001", "train.router_orthogonal_loss_coef=0.01",
                  "train.max_steps=1", "train.logging_steps=1", "train.learning_rate=0.0")
    logged = next(h for h in state["log_history"] if "orthogonal_loss" in h)
    base = load_model(str(tiny_vl), "float32", "sdpa")
    weights = [p.detach() for n, p in base.named_parameters() if n.endswith(("text_moe.gate.weight", "vision_moe.gate.weight"))]
    assert len(weights) == 6 and len(routers(base)) == 6
    assert logged["orthogonal_loss"] == pytest.approx(orthogonal_loss(weights).item(), rel=1e-5)
    assert logged["z_loss"] > 0


# text-only records beside the pictures: 16 of the 24 rows hold no image (at data.max_length 80 each sample is a row of
# its own), so some process's micro-batch has none while another's has one (train.seed 0: steps 1 and 2)
TEXT_ONLY = [{"messages": [{"role": "user", "content": f"Name colour number {i}."}, {"role": "assistant", "content": answer}]}
             for i, answer in enumerate(["Red.", "Green.", "Blue.", "Yellow."] * 4)]


def mixed_data(folder: Path) -> Path:
    """colours.jsonl's 8 image-text records and the 16 text-only ones in one file (the pictures linked beside it)."""
    (folder / "colours").symlink_to(COLOURS, target_is_directory=True)
    path = folder / "mixed.jsonl"
    records = (RECIPES / "data" / "colours.jsonl").read_text().splitlines() + [json.dumps(r) for r in TEXT_ONLY]
    path.write_text("\n".join(records) + "\n")
    return path


@pytest.mark.slow  # ~45 s: two launches of two processes and a single one
def test_vl_two_processes_train_like_one_with_twice_the_accumulation(tmp_path, tiny_vl):
    """DDP and FSDP2 over 2 gloo processes, a row each of image-text and text-only samples, against 1 process
    accumulating 2 rows: the same step losses (fp32; only summation order differs, rel 1e-6), and the same tokens
    trained: each process reads the data and its images itself and takes its share of the rows. LoRA with
    `lora.vision`: a row without images leaves out the vision experts and the encoder and resampler, all trained;
    they take part all the same (model/vl.py), or DDP and FSDP2 would stop at the first such step."""
    import subprocess
    import sys

    data = mixed_data(tmp_path)
    shipped = (RECIPES / "accelerate" / "fsdp2.yaml").read_text().splitlines()  # fp32 compute, as the fp32 DDP run
    fsdp2 = tmp_path / "fsdp2.yaml"
    fsdp2.write_text("\n".join('mixed_precision: "no"' if line.startswith("mixed_precision:") else line for line in shipped) + "\n")

    def run(out: Path, *more: str):
        command = [sys.executable, "-m", "erniekit_lite", "train", str(RECIPES / "quickstart-vl.yaml"), f"model.path={tiny_vl}",
                   f"output.dir={out}", f"data.train.0.path={data}", "data.max_length=80", "lora.r=8", "lora.vision=true",
                   "train.learning_rate=1e-2", "train.max_steps=3", "train.logging_steps=1", "train.save_steps=100", *more]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert done.returncode == 0, done.stderr[-3000:]
        state = json.loads((out / "trainer_state.json").read_text())
        return [h["loss"] for h in state["log_history"] if "loss" in h], json.loads((out / "train_results.json").read_text())

    one, one_results = run(tmp_path / "one", "train.gradient_accumulation_steps=2")
    for strategy, more in (("DDP", ()), ("FSDP2", ("--accelerate-config", str(fsdp2)))):
        two, two_results = run(tmp_path / strategy, "--num-processes", "2", *more)
        assert two_results["distributed"]["strategy"] == strategy
        assert len(two) == 3 and two == pytest.approx(one, rel=1e-6), strategy
        assert two_results["train_tokens"] == one_results["train_tokens"] > 0


def test_a_row_without_images_gives_the_vision_parts_a_zero_gradient_and_changes_nothing_else(tiny_vl, monkeypatch):
    """A text-only row through the scoring forward, full fine-tuning with `model.train_vision`: every trained
    parameter gets a gradient, the vision experts', encoder's and resampler's exactly zero (what DDP and FSDP2 need of
    every process, model/vl.py), and the log-probs and every other gradient are bit for bit those of the same forward
    leaving the vision parts out (as it did before)."""
    import torch
    from transformers import AutoTokenizer

    from erniekit_lite.data import vl
    from erniekit_lite.data.vl_rows import VLPackedCollator, VLRow
    from erniekit_lite.model import vl as model_vl
    from erniekit_lite.model.load import load_model
    from erniekit_lite.train import scored

    template = vl.VLTemplate(AutoTokenizer.from_pretrained(tiny_vl), model_vl.image_processor(str(tiny_vl)))
    rows = [VLRow(template.samples(vl.messages_of(r, tiny_vl, "x"), "x")) for r in TEXT_ONLY[:2]]
    batch = VLPackedCollator(80, rows)([{"row": 0}, {"row": 1}])
    assert "pixel_values" not in batch

    def step():
        model = load_model(str(tiny_vl), "float32", "packed_sdpa")
        scored.take(model)
        inputs = {k: batch[k] for k in ("input_ids", "position_ids", "moe_mm_token_type_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                                        "max_length_q", "max_length_k", "score_positions", "score_targets")}
        scores = model.train()(**inputs, score_labels=batch["labels"], output_router_logits=True)
        (-scores.log_probs.mean() + 0.01 * scores.aux_loss).backward()
        return scores.log_probs.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    log_probs, grads = step()
    with monkeypatch.context() as patch:
        patch.setattr(model_vl, "without_images", lambda model, inputs: None)
        left_out_log_probs, left_out = step()
    vision = [n for n in grads if n.startswith(model_vl.VISION_MODULES) or ".vision_moe." in n]
    assert vision and all(left_out[n] is None for n in vision)  # before: these were never reduced (DDP stopped)
    assert all(grads[n] is not None and not grads[n].any() for n in vision)
    assert torch.equal(log_probs, left_out_log_probs)
    assert all(torch.equal(grads[n], left_out[n]) for n in grads if n not in vision)
