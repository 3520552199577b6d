"""`erniekit-lite push` and a recipe's `hub:` section, end to end against a local stand-in of the Hub (tests/fake_hub.py).

Pushes run in a fresh process, as a user runs them: huggingface_hub reads HF_ENDPOINT, HF_HUB_DISABLE_XET (its
single-commit upload path, which the stand-in speaks) and HF_HOME (no saved login) when it is imported, and the
process's stdout and stderr are exactly what the user sees.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from erniekit_lite.cli import main
from erniekit_lite.hub import CARD_MARK, model_card
from erniekit_lite.plots import write_loss_plot
from erniekit_lite.recipe import Recipe
from fake_hub import FakeHub

ROOT = Path(__file__).resolve().parents[1]
IDENTITY = ROOT / "recipes" / "data" / "identity.jsonl"
TOKEN = "hf_FAKEerniekitLiteTestToken0123456789"
REPO = "someone/tiny-ernie-lora"


def tiny_lora_recipe(model_dir: Path, out: Path, **sections) -> dict:
    return {
        "model": {"path": str(model_dir)},
        "data": {"train": [str(IDENTITY)], "max_length": 128},
        "lora": {"r": 4, "alpha": 8},
        "output": {"dir": str(out)},
        # a save every step: the run dir gets checkpoint-1/ and checkpoint-2/, which must never be pushed
        "train": {"learning_rate": 1e-3, "max_steps": 2, "per_device_train_batch_size": 2, "activation_checkpointing": False,
                  "logging_steps": 1, "save_steps": 1, "seed": 0},
        **sections,
    }


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_own_dir) -> Path:
    """A finished tiny LoRA SFT run, made by the CLI."""
    tmp = tmp_path_factory.mktemp("lora-run")
    recipe = tmp / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_lora_recipe(tiny_own_dir, tmp / "out")))
    assert main(["train", str(recipe)]) == 0
    return tmp / "out"


@pytest.fixture
def hub():
    with FakeHub(TOKEN) as server:
        yield server


def cli(hub: FakeHub, tmp_path: Path, *argv, token: str | None = TOKEN) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_")) and k != "TRANSFORMERS_OFFLINE"}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_XET="1")
    if token is not None:
        env["HF_TOKEN"] = token
    command = [sys.executable, "-m", "erniekit_lite", *map(str, argv)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def assert_token_kept_secret(hub: FakeHub, result: subprocess.CompletedProcess, *folders: Path, token: str = TOKEN) -> None:
    assert hub.authorizations and all(a == f"Bearer {token}" for a in hub.authorizations)  # sent, on every call
    assert token not in result.stdout + result.stderr
    for repo in hub.repos.values():
        for files in repo.branches.values():
            assert not any(token.encode() in data for data in files.values())
    for folder in folders:
        assert not any(token.encode() in data for data in snapshot(folder).values())


def test_push_uploads_the_run_and_a_valid_model_card(lora_run, hub, tmp_path):
    run = copy_of(lora_run, tmp_path)
    # As if trained on the released base with a Hub dataset besides the local file: the metadata names both
    adapter = json.loads((run / "adapter_config.json").read_text())
    (run / "adapter_config.json").write_text(json.dumps({**adapter, "base_model_name_or_path": "baidu/ERNIE-4.5-0.3B-PT"}))
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["data"]["train"].append({"path": "someone/identity-chats", "format": "auto", "split": "train", "max_samples": None})
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    (run / "loss.png").unlink()  # push draws it when training did not
    before = snapshot(run)

    result = cli(hub, tmp_path, "push", run, "--repo", REPO, "--private", "--revision", "dev")
    assert result.returncode == 0, result.stderr

    assert hub.repos[REPO].private and hub.files(REPO, "main") == {".gitattributes": b"*.safetensors filter=lfs\n"}
    uploaded = {name: data for name, data in hub.files(REPO, "dev").items() if name != ".gitattributes"}
    local = {p.name for p in run.iterdir() if p.is_file()}
    assert set(uploaded) == local - {"training_args.bin"}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "recipe.yaml", "train_results.json", "loss.png", "README.md"} <= set(uploaded)
    assert not any(n.startswith("checkpoint-") or n in ("optimizer.pt", "scheduler.pt", "training_args.bin") for n in uploaded)
    for name, data in uploaded.items():
        assert data == (run / name).read_bytes(), name
    assert uploaded["loss.png"].startswith(b"\x89PNG")
    # Only the card (now naming the repo) and the new loss plot changed locally
    after = snapshot(run)
    assert {k for k in after if before.get(k) != after[k]} == {"README.md", "loss.png"} and set(before) <= set(after)

    from huggingface_hub import ModelCard, ModelCardData

    card = ModelCard(uploaded["README.md"].decode())
    expected = {"base_model": "baidu/ERNIE-4.5-0.3B-PT", "library_name": "peft", "license": "apache-2.0",
                "tags": ["ernie4.5", "erniekit-lite", "sft", "lora"], "datasets": ["someone/identity-chats"],
                "pipeline_tag": "text-generation"}
    assert card.data.to_dict() == expected
    assert ModelCardData(**card.data.to_dict()).to_dict() == expected
    text = card.text
    assert CARD_MARK in text and f'PeftModel.from_pretrained(base, "{REPO}", revision="dev")' in text and "MoE" in text
    for row in ("| method | SFT", "| fine-tuning | LoRA r 4, alpha 8", "| learning rate | 0.001", "| training | 2 steps",
                "| max_length | 128 tokens", "| packing | padding-free rows", "| samples | 18 samples", "`identity.jsonl`",
                "| train loss |", "| real tokens/s |", "![loss](loss.png)"):
        assert row in text, row
    assert str(tmp_path) not in text  # no local paths in a public card
    assert_token_kept_secret(hub, result, run)


def test_a_failing_hub_is_one_line_and_changes_nothing(lora_run, hub, tmp_path):
    before = snapshot(lora_run)
    hub.fail("commit", *[500] * 10)
    result = cli(hub, tmp_path, "push", lora_run, "--repo", REPO)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"error: push to {REPO}: ") and "HTTP 500" in result.stderr
    assert hub.count("commit") == 3 and "README.md" not in hub.files(REPO)
    assert_token_kept_secret(hub, result, lora_run)

    calls = len(hub.calls)
    result = cli(hub, tmp_path, "push", lora_run, "--repo", REPO, token=None)
    assert result.returncode == 2 and "HF_TOKEN" in result.stderr and "hf auth login" in result.stderr
    assert len(hub.calls) == calls  # stopped before asking the Hub anything

    result = cli(hub, tmp_path, "push", lora_run, "--repo", REPO, token="hf_FAKErefusedByTheHub")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "401" in result.stderr and "HF_TOKEN" in result.stderr
    assert "hf_FAKErefusedByTheHub" not in result.stdout + result.stderr

    result = cli(hub, tmp_path, "push", lora_run, "--repo", "not-a-repo-id")
    assert result.returncode == 2 and "USER/NAME" in result.stderr
    assert snapshot(lora_run) == before


def test_a_transient_failure_is_retried(lora_run, hub, tmp_path):
    run = copy_of(lora_run, tmp_path)
    hub.fail("commit", 503)
    result = cli(hub, tmp_path, "push", run, "--repo", REPO)
    assert result.returncode == 0, result.stderr
    assert hub.count("commit") == 2 and "retrying" in result.stdout
    assert hub.files(REPO)["adapter_model.safetensors"] == (run / "adapter_model.safetensors").read_bytes()
    assert_token_kept_secret(hub, result, run)


def test_a_users_readme_is_kept_and_the_upload_gets_the_card(lora_run, hub, tmp_path):
    run = copy_of(lora_run, tmp_path)
    (run / "README.md").write_text("# my own notes\n")
    result = cli(hub, tmp_path, "push", run, "--repo", REPO)
    assert result.returncode == 0, result.stderr
    assert (run / "README.md").read_text() == "# my own notes\n" and "kept" in result.stdout
    assert hub.repos[REPO].private  # neither --private nor --public: a new repository is private
    assert CARD_MARK in hub.files(REPO)["README.md"].decode()


def test_push_merged_uploads_a_plain_checkpoint(lora_run, hub, tmp_path):
    before = snapshot(lora_run)
    result = cli(hub, tmp_path, "push", lora_run, "--repo", "someone/tiny-ernie-merged", "--merged", "--public")
    assert result.returncode == 0, result.stderr
    assert not hub.repos["someone/tiny-ernie-merged"].private  # published only when asked
    uploaded = hub.files("someone/tiny-ernie-merged")
    assert {"model.safetensors", "config.json", "tokenizer.json", "recipe.yaml", "train_results.json", "loss.png", "README.md"} <= set(uploaded)
    assert not any(name.startswith("adapter_") for name in uploaded)
    from huggingface_hub import ModelCard

    card = ModelCard(uploaded["README.md"].decode())
    assert card.data.library_name == "transformers" and "lora" in card.data.tags
    assert 'AutoModelForCausalLM.from_pretrained("someone/tiny-ernie-merged")' in card.text
    assert snapshot(lora_run) == before  # the run dir holds the adapter; the merged card is not written there

    # What arrived is the tuned model, loadable by transformers alone
    import torch
    from transformers import AutoModelForCausalLM

    from erniekit_lite.model.load import load_model

    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    for name, data in uploaded.items():
        (downloaded / name).write_bytes(data)
    merged = AutoModelForCausalLM.from_pretrained(downloaded).eval()
    tuned = load_model(str(lora_run), trainable_adapter=False).eval()
    ids = torch.tensor([[3, 10, 20, 30, 40]])
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, tuned(input_ids=ids).logits, atol=1e-5)


def test_push_ema_uploads_the_runs_ema_dir(lora_run, hub, tmp_path):
    """`push RUN --ema` uploads RUN/ema (here a stand-in: a copy of the run's own files; tests/test_ema.py trains a
    real one), and without one it is a one-line error that uploads nothing."""
    run = copy_of(lora_run, tmp_path)
    result = cli(hub, tmp_path, "push", run, "--repo", "someone/tiny-ernie-ema", "--ema")
    assert result.returncode != 0 and not hub.repos
    assert result.stderr.strip().splitlines()[-1].endswith(f"{run}: no finished weight EMA in it ({run / 'ema'}); "
                                                           "train with train.ema to write one")
    (run / "ema").mkdir()
    for file in run.iterdir():
        if file.is_file():
            shutil.copy2(file, run / "ema" / file.name)
    (run / "ema" / "adapter_model.safetensors").write_bytes(b"stand-in")  # what tells the upload came from ema/
    result = cli(hub, tmp_path, "push", run, "--repo", "someone/tiny-ernie-ema", "--ema")
    assert result.returncode == 0, result.stderr
    assert hub.files("someone/tiny-ernie-ema")["adapter_model.safetensors"] == b"stand-in"


def test_recipe_hub_pushes_when_training_ends(tiny_own_dir, hub, tmp_path):
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_lora_recipe(tiny_own_dir, out, hub={"repo_id": "someone/from-recipe"})))
    result = cli(hub, tmp_path, "train", recipe)
    assert result.returncode == 0, result.stderr
    uploaded = hub.files("someone/from-recipe")
    for name in ("adapter_model.safetensors", "recipe.yaml", "train_results.json", "loss.png", "README.md"):
        assert uploaded[name] == (out / name).read_bytes(), name
    assert "train_samples" in json.loads(uploaded["train_results.json"])
    assert hub.repos["someone/from-recipe"].private  # hub.private left blank: a new repository is private
    assert 'PeftModel.from_pretrained(base, "someone/from-recipe")' in uploaded["README.md"].decode()
    assert_token_kept_secret(hub, result, out)


def test_recipe_hub_without_a_token_stops_before_training(tiny_own_dir, tmp_path, capsys, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # as without HF_TOKEN or a saved login
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_lora_recipe(tiny_own_dir, tmp_path / "out", hub={"repo_id": "someone/from-recipe"})))
    assert main(["train", str(recipe)]) == 2
    assert "push to someone/from-recipe" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_push_failing_after_training_says_how_to_push_again(lora_run, hub, tmp_path, monkeypatch):
    """In process, as `train` calls it; huggingface_hub's import-time settings are patched instead of set in the env."""
    import huggingface_hub.constants

    from erniekit_lite import hub as hub_module
    from erniekit_lite.errors import UserError

    for name, value in (("ENDPOINT", hub.url), ("HF_HUB_DISABLE_XET", True), ("HF_HUB_OFFLINE", False)):
        monkeypatch.setattr(huggingface_hub.constants, name, value)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(hub_module, "RETRY_WAITS", (0, 0))
    run = copy_of(lora_run, tmp_path)
    recipe = Recipe.model_validate({**yaml.safe_load((run / "recipe.yaml").read_text()),
                                    "hub": {"repo_id": REPO, "private": True, "revision": "dev"}})
    hub.fail("commit", 502, 502, 502)
    with pytest.raises(UserError) as failure:
        hub_module.after_training(run, recipe, log=lambda *args: None)
    message = str(failure.value)
    assert "\n" not in message and "HTTP 502" in message and f"erniekit-lite push {run} --repo {REPO} --private --revision dev" in message
    assert hub.count("commit") == 3
    assert f'PeftModel.from_pretrained(base, "{REPO}", revision="dev")' in (run / "README.md").read_text()  # the run's own card


def test_card_of_a_full_dpo_run(tmp_path):
    recipe = Recipe.model_validate({
        "model": {"path": "baidu/ERNIE-4.5-0.3B-PT"}, "method": "dpo", "data": {"train": ["pairs.jsonl"], "max_length": 512},
        "output": {"dir": str(tmp_path)}, "train": {"beta": 0.2, "learning_rate": 5e-7, "lr_scheduler_type": "cosine"},
    })
    results = {"train_loss": 0.41, "eval_loss": 0.5, "train_tokens_per_second": 1234.4, "rewards/accuracies": 0.75,
               "eval_rewards/accuracies": 0.8, "packing_efficiency": 0.9, "train_samples": 64, "epoch": 1.0}
    (tmp_path / "train_results.json").write_text(json.dumps(results))
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 8, "log_history": []}))

    from huggingface_hub import ModelCard

    card = ModelCard(model_card(tmp_path, recipe, "someone/ernie-dpo"))
    assert card.data.to_dict() == {"base_model": "baidu/ERNIE-4.5-0.3B-PT", "library_name": "transformers", "license": "apache-2.0",
                                   "tags": ["ernie4.5", "erniekit-lite", "dpo"], "pipeline_tag": "text-generation"}
    for row in ("| method | DPO (sigmoid, beta 0.2)", "| fine-tuning | full fine-tuning", "| learning rate | 5e-07, cosine",
                "| training | 8 steps (1.00 epochs)", "| samples | 64 preference pairs", "| eval loss | 0.5000",
                "| real tokens/s | 1,234", "| reward accuracy (last step) | 0.75", "| eval reward accuracy | 0.80"):
        assert row in card.text, row
    assert "PeftModel" not in card.text and "loss.png" not in card.text  # no plot: none was drawn


def test_loss_plot_needs_a_logged_loss(tmp_path):
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"log_history": [{"step": 2, "train_loss": 1.0}]}))
    assert write_loss_plot(tmp_path) is None and not (tmp_path / "loss.png").exists()
    state.write_text(json.dumps({"log_history": [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}, {"step": 2, "eval_loss": 1.7}]}))
    assert write_loss_plot(tmp_path).read_bytes().startswith(b"\x89PNG")


def test_the_cards_multi_turn_snippet_feeds_the_ids_training_used(tmp_path, ernie_tokenizer):
    """The card's `prompt_ids` gives the training prefix of a later turn (history answers tokenized on their own),
    where `apply_chat_template(tokenize=True)` does not (benchmarks/results-serving_tokens.txt counts how often)."""
    import re

    import torch

    from erniekit_lite.data.formats import Turn
    from erniekit_lite.data.template import template_for
    from erniekit_lite.data.tokenize import Tokenizer

    ernie_tokenizer.save_pretrained(tmp_path)
    recipe = Recipe.model_validate({"model": {"path": "baidu/ERNIE-4.5-0.3B-PT"}, "data": {"train": ["d.jsonl"]}, "output": {"dir": str(tmp_path)}})
    card = model_card(tmp_path, recipe, "someone/ernie")
    code = re.search(r"(def prompt_ids\(.*?return torch\.tensor\(\[ids\]\)\n)", card, re.S).group(1)
    scope = {"torch": torch}
    exec(code, scope)
    tok = Tokenizer(ernie_tokenizer, template_for(ernie_tokenizer))
    history = [Turn("Who are you?", "Hello, I am a tuned ERNIE."), Turn("2+2?", "4")]
    for system in ("Be brief.", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            m for t in history for m in ({"role": "user", "content": t.user}, {"role": "assistant", "content": t.assistant})
        ] + [{"role": "user", "content": "What can you do?"}]
        pieces = tok.template.generation_prompt(system, history, "What can you do?")
        encoded = iter(tok.encode_pieces(pieces))
        expected = [t for p in pieces for t in (next(encoded) if p.text is not None else p.ids)]
        assert scope["prompt_ids"](ernie_tokenizer, messages)[0].tolist() == expected
        one_string = ernie_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        assert list(one_string) != expected  # the difference the snippet is there for
    assert "prompt_ids" in model_card(tmp_path / "missing", recipe, "someone/ernie")  # no tokenizer files: the base's (ERNIE)
    import copy

    own = copy.deepcopy(ernie_tokenizer)  # a model with its own template (the Thinking model's): no ERNIE snippet
    own.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"
    own.save_pretrained(tmp_path / "own")
    assert "prompt_ids" not in model_card(tmp_path / "own", recipe, "someone/ernie")
