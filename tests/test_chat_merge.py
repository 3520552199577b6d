"""`chat` and `merge` on a tiny LoRA run: streamed answers equal the template-based greedy answers, history is
used, and a merged checkpoint loads with plain transformers and gives base+adapter's logits."""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path

import pytest
import torch
import yaml

from erniekit_lite.cli import main
from erniekit_lite.data.formats import Turn
from erniekit_lite.generate import answer
from erniekit_lite.model.load import load_model, load_tokenizer
from helpers import make_adapter_visible, run_cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_own_dir):
    tmp = tmp_path_factory.mktemp("lora-run")
    recipe = {
        "model": {"path": str(tiny_own_dir)},
        "data": {"train": [str(ROOT / "recipes" / "data" / "identity.jsonl")], "max_length": 256},
        "lora": {"r": 4, "alpha": 8},
        "output": {"dir": str(tmp / "run")},
        "train": {"learning_rate": 1e-2, "max_steps": 3, "per_device_train_batch_size": 2, "activation_checkpointing": False},
    }
    (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", str(tmp / "r.yaml")]) == 0
    return make_adapter_visible(tmp / "run")  # B is near zero after 3 steps


def greedy(path, prompt, history=None, tokens=12):
    model = load_model(str(path), "float32", "sdpa", trainable_adapter=False).eval()
    model.config.use_cache = True
    return answer(model, load_tokenizer(str(path)), prompt, history=history, max_new_tokens=tokens)


def test_one_shot_chat_streams_the_greedy_template_answer(capsys, lora_run, tiny_own_dir):
    code, out, err = run_cli(capsys, "chat", lora_run, "--prompt", "Who are you?", "--max-new-tokens", "12")
    assert code == 0, err
    expected = greedy(lora_run, "Who are you?")
    assert expected and out == expected + "\n"
    # the same adapter given explicitly on its base answers the same; the base alone answers differently
    assert run_cli(capsys, "chat", tiny_own_dir, "--adapter", lora_run, "--prompt", "Who are you?", "--max-new-tokens", "12")[1] == out
    assert run_cli(capsys, "chat", tiny_own_dir, "--prompt", "Who are you?", "--max-new-tokens", "12")[1] != out


def test_a_vl_model_asked_without_an_image_is_said_to_have_seen_none(capsys, monkeypatch, tiny_vl_dir):
    """An ERNIE-4.5-VL model answers a question about "this picture" with none shown (about a picture it never saw):
    one-shot, a note on stderr (the answer alone on stdout); interactive, a note before the answer until an image has
    been shown in the conversation, and again after /reset."""
    picture = ROOT / "recipes" / "data" / "colours" / "red.png"
    code, out, err = run_cli(capsys, "chat", tiny_vl_dir, "--prompt", "What colour is this picture?", "--max-new-tokens", "2")
    assert code == 0 and err.strip().splitlines()[-1] == ("note: no image shown: this ERNIE-4.5-VL model answers from the "
                                                          "text alone (--image FILE shows one)"), err
    assert "no image" not in out
    code, out, err = run_cli(capsys, "chat", tiny_vl_dir, "--image", picture, "--prompt", "What colour?", "--max-new-tokens", "2")
    assert code == 0 and "no image shown" not in err + out
    monkeypatch.setattr("sys.stdin", io.StringIO(f"Colour?\n/image {picture}\nColour?\nAnd now?\n/reset\nColour?\n"))
    code, out, err = run_cli(capsys, "chat", tiny_vl_dir, "--max-new-tokens", "2")
    note = "(no image shown: this ERNIE-4.5-VL model answers from the text alone; /image FILE shows one)\n"
    turns = out.split("User: ")[1:]
    assert code == 0 and [t.startswith(note) for t in turns] == [True, False, False, False, False, True, False], out


def test_interactive_chat_keeps_history_until_reset(capsys, monkeypatch, lora_run):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello!\nWho are you?\n/reset\nWho are you?\n"))
    code, out, err = run_cli(capsys, "chat", lora_run, "--max-new-tokens", "8")
    assert code == 0, err
    first = greedy(lora_run, "Hello!", tokens=8)
    second = greedy(lora_run, "Who are you?", history=[Turn("Hello!", first)], tokens=8)
    fresh = greedy(lora_run, "Who are you?", tokens=8)
    assert second != fresh  # the history changes the answer, so the check below means something
    assert out.split("User: ")[1:] == [f"Assistant: {first}\n", f"Assistant: {second}\n", "(history cleared)\n", f"Assistant: {fresh}\n", "\n"]


def test_chat_and_merge_errors_are_one_line(capsys, tmp_path, tiny_own_dir):
    for argv, message in (
        (["chat", tiny_own_dir, "--adapter", tiny_own_dir, "--prompt", "x"], "not a LoRA adapter dir"),
        (["chat", tiny_own_dir, "--prompt", "x", "--top-p", "0"], "--top-p"),
        (["merge", tiny_own_dir, "--out", tmp_path / "m"], "not a LoRA output dir"),
    ):
        code, out, err = run_cli(capsys, *argv)
        assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "m").exists()
    # chat's PATH is its own argument: the line names the path, not a recipe's model.path
    code, out, err = run_cli(capsys, "chat", "./no-such-run", "--prompt", "x")
    assert code == 2 and err == "error: ./no-such-run: no such directory here, and not a valid Hugging Face Hub repo id (ORG/NAME)\n", err


def test_merged_checkpoint_loads_with_plain_transformers(capsys, tmp_path, lora_run, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    code, out, err = run_cli(capsys, "merge", lora_run, "--out", tmp_path / "merged")
    assert code == 0, err
    merged_dir = tmp_path / "merged"
    names = {p.name for p in merged_dir.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"} <= names
    assert not any(n.startswith("adapter_") for n in names)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert merged.dtype == torch.float32  # the base's dtype
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    ids = tokenizer("User: Who are you?\nAssistant: ", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = load_model(str(lora_run), "float32", "sdpa").eval()(input_ids=ids).logits
        assert (merged(input_ids=ids).logits - expected).abs().max().item() <= 1e-5

    before = (merged_dir / "model.safetensors").read_bytes()
    code, out, err = run_cli(capsys, "merge", lora_run, "--out", merged_dir)
    assert code == 2 and "not empty" in err and (merged_dir / "model.safetensors").read_bytes() == before
    assert run_cli(capsys, "merge", lora_run, "--out", merged_dir, "--overwrite")[0] == 0
    # weights follow the umask (safetensors' writer makes them 0600): the merge's and the run's own
    mask = os.umask(0o022)
    os.umask(mask)
    assert stat.S_IMODE((merged_dir / "model.safetensors").stat().st_mode) == 0o666 & ~mask
    # (the run's own final adapter was rewritten by make_adapter_visible, a test helper: its checkpoint is as trained)
    assert stat.S_IMODE((lora_run / "checkpoint-3" / "adapter_model.safetensors").stat().st_mode) == 0o666 & ~mask

    # replacing is atomic: the new merge renamed in fails (a stand-in for a crash there), the old one is still whole
    before, rename = (merged_dir / "model.safetensors").read_bytes(), Path.rename

    def failing(self, target):
        if ".merging-" in self.name:
            raise OSError("renaming the new merge in failed (stand-in)")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing)
    with pytest.raises(OSError, match="stand-in"):
        main(["merge", str(lora_run), "--out", str(merged_dir), "--overwrite"])
    monkeypatch.undo()
    assert (merged_dir / "model.safetensors").read_bytes() == before and not list(tmp_path.glob(".merged.replaced-*"))
    assert not list(tmp_path.glob(".merged.merging-*"))  # the failed merge's staging folder went with it
    user_dir = tmp_path / "mine"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("keep me")
    code, out, err = run_cli(capsys, "merge", lora_run, "--out", user_dir, "--overwrite")
    assert code == 2 and "not a previous merge" in err and (user_dir / "notes.txt").read_text() == "keep me"


def test_base_dtype_comes_from_the_config(tmp_path, tiny_own_dir):
    from erniekit_lite.model.merge import base_dtype

    config = json.loads((tiny_own_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert base_dtype(str(tmp_path)) == "bfloat16" and base_dtype(str(tiny_own_dir)) == "float32"
