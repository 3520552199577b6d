"""The CLI end to end on tiny models: train (full and LoRA), validate, tiny, and every bad-input path."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHARED_HOW, missing
import torch
import yaml

from erniekit_lite.cli import main
from erniekit_lite.errors import UserError
from helpers import run_cli, shared_data, write_recipe

ROOT = Path(__file__).resolve().parents[1]
IDENTITY = ROOT / "recipes" / "data" / "identity.jsonl"


def recipe_file(tmp_path: Path, model_dir: Path, data: dict | None = None, **changes) -> Path:
    train = {"learning_rate": 3e-3, "max_steps": 120, "per_device_train_batch_size": 2, "activation_checkpointing": False,
             "logging_steps": 10, "save_steps": 120, "seed": 0, "lr_scheduler_type": "cosine"}
    return write_recipe(tmp_path / "recipe.yaml", model_dir, data={"train": [{"path": str(IDENTITY)}], **(data or {})}, train=train,
                        output={"sample_prompts": ["Who are you?"]}, **changes)


def test_version(capsys):
    from erniekit_lite import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"erniekit-lite {__version__}\n"


def test_help_does_not_import_torch():
    code = "import sys, erniekit_lite.cli; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-m", "erniekit_lite", "--help"], check=True, capture_output=True, text=True).stdout
    assert "train" in out and "validate" in out and "tiny" in out


def test_tiny_checkpoints_load_offline(tiny_own_dir, tiny_moe_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dense = AutoModelForCausalLM.from_pretrained(tiny_own_dir)
    assert type(dense).__name__ == "Ernie4_5ForCausalLM"
    moe = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    assert type(moe).__name__ == "Ernie4_5_MoeForCausalLM"
    names = [n for n, _ in moe.named_parameters()]
    assert "model.layers.0.mlp.gate_proj.weight" in names  # first layer dense
    assert "model.layers.1.mlp.experts.gate_up_proj" in names  # fused routed experts
    assert any(n.startswith("model.layers.1.mlp.shared_experts.") for n in names)
    tok = AutoTokenizer.from_pretrained(tiny_own_dir)
    assert [tok.convert_tokens_to_ids(t) for t in ("<unk>", "<s>", "</s>")] == [0, 1, 2]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) == "<|begin_of_sentence|>User: hi\nAssistant: "


def test_train_full_memorises_and_reports(tmp_path, capsys, tiny_own_dir):
    path = recipe_file(tmp_path, tiny_own_dir)
    code, out, err = run_cli(capsys, "train", path)
    assert code == 0, err
    run = tmp_path / "out"
    results = json.loads((run / "train_results.json").read_text())
    for key in ("train_loss", "train_runtime", "train_tokens", "train_tokens_per_second", "packing_efficiency"):
        assert key in results
    # The token count from the data itself: 120 steps x 2 rows cover whole epochs of the packed rows
    from erniekit_lite.data.prepare import prepare
    from erniekit_lite.model.load import load_tokenizer
    from erniekit_lite.recipe import load

    recipe = load(str(path), [])
    rows = prepare(recipe.data, load_tokenizer(str(tiny_own_dir)), log=lambda *a: None).train.rows
    epochs, rest = divmod(120 * 2, len(rows))
    assert rest == 0
    real = sum(len(r.input_ids) for r in rows)
    assert results["train_tokens"] == epochs * real
    assert results["packing_efficiency"] == round(real / (len(rows) * 128), 4)
    logged = [h for h in json.loads((run / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    history = [h["loss"] for h in logged]
    assert len(history) >= 5 and history[-1] < 0.5 * history[0]
    # each log a line of text, not transformers' Python dict (in a pipe, as here: no progress bar)
    first = logged[0]
    assert f"step {first['step']}/120: loss {first['loss']:.4g}, grad_norm " in out and "{'loss'" not in out
    assert "it/s]" not in out + err  # no tqdm bars either (transformers' loading and saving ones)
    # the last line gives the first and last logged loss beside the run's mean (the mean alone read as no progress)
    assert (f"done: loss {results['train_loss']:.4f} (mean over the run; logged {history[0]:.4f} at step {logged[0]['step']}, "
            f"{history[-1]:.4f} at step {logged[-1]['step']}), ") in out
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    assert sample["answer"] == "I am Wenxin-Tiny, a small assistant fine-tuned with erniekit-lite."
    assert yaml.safe_load((run / "recipe.yaml").read_text())["train"]["max_steps"] == 120

    # the saved run reloads as a plain transformers model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run)
    assert model.config.model_type == "ernie4_5"


def test_train_lora_saves_adapter_that_reloads(tmp_path, capsys, tiny_own_dir):
    code, out, err = run_cli(capsys, "train", recipe_file(tmp_path, tiny_own_dir, lora={"r": 8, "alpha": 16}, train__learning_rate=1e-2, train__max_steps=40))
    assert code == 0, err
    run = tmp_path / "out"
    adapter = json.loads((run / "adapter_config.json").read_text())
    assert set(adapter["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert adapter["base_model_name_or_path"] == str(tiny_own_dir)
    history = [h["loss"] for h in json.loads((run / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert history[-1] < history[0]

    from erniekit_lite.model.load import load_model

    tuned = load_model(str(run), trainable_adapter=False).eval()
    base = load_model(str(tiny_own_dir)).eval()
    ids = torch.tensor([[3, 10, 20, 30, 40]])
    with torch.no_grad():
        assert (tuned(input_ids=ids).logits - base(input_ids=ids).logits).abs().max() > 1e-3


def test_validate_prints_plan(tmp_path, capsys, tiny_own_dir):
    code, out, err = run_cli(capsys, "validate", recipe_file(tmp_path, tiny_own_dir), "lora.r=4")
    assert code == 0, err
    assert "18 records -> 18 samples" in out
    assert "Ernie4_5ForCausalLM" in out and "LoRA r=4" in out
    assert "packing efficiency" in out and "optimizer steps" in out and "p95" in out
    assert not (tmp_path / "out").exists()  # validate writes nothing


def test_unpacked_training_runs(tmp_path, capsys, tiny_own_dir):
    code, out, err = run_cli(capsys, "train", recipe_file(tmp_path, tiny_own_dir), "data.packing=false", "train.max_steps=3")
    assert code == 0, err
    results = json.loads((tmp_path / "out" / "train_results.json").read_text())
    assert results["packing_efficiency"] < 1.0  # padding counted


def _bad(capsys, *argv) -> str:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_bad_inputs_are_one_line_errors(tmp_path, capsys, tiny_own_dir):
    missing = tmp_path / "missing.jsonl"
    assert f"data.train.0.path: {missing}: no such file (relative paths are resolved from the working directory)" in _bad(
        capsys, "train", recipe_file(tmp_path, tiny_own_dir, data={"train": [str(missing)]}))

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"src": ["a"], "tgt": ["b"]}\n{"src": ["a"], "tgt": ["b"]}\n{"src": ["a"], "tgt": \n')
    assert f"{broken}:3: malformed JSON line" in _bad(capsys, "train", recipe_file(tmp_path, tiny_own_dir, data={"train": [str(broken)]}))

    no_output = tmp_path / "alpaca.json"
    no_output.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "c"}\n]\n')
    assert f"{no_output}:3: missing field 'output'" in _bad(capsys, "validate", recipe_file(tmp_path, tiny_own_dir, data={"train": [str(no_output)]}))

    assert "unknown key 'lerning_rate' in train; did you mean 'learning_rate'?" in _bad(
        capsys, "train", recipe_file(tmp_path, tiny_own_dir), "train.lerning_rate=1e-3"
    )
    assert "data.max_length: Input should be a valid integer" in _bad(capsys, "validate", recipe_file(tmp_path, tiny_own_dir), "data.max_length=big")
    assert "no-model: no such folder" in _bad(capsys, "validate", recipe_file(tmp_path, tmp_path / "no-model"))


def test_empty_dataset_after_filtering(tmp_path, capsys, tiny_own_dir):
    long = tmp_path / "long.jsonl"
    long.write_text("".join(json.dumps({"src": ["q"], "tgt": ["word " * 50]}) + "\n" for _ in range(3)))
    masked = tmp_path / "masked.jsonl"
    masked.write_text(json.dumps({"src": ["q"], "tgt": ["a"], "label": [0]}) + "\n")
    data = {"train": [str(long), str(masked)], "max_length": 32, "overlong": "drop"}
    err = _bad(capsys, "train", recipe_file(tmp_path, tiny_own_dir, data=data))
    assert "no trainable samples left after filtering (3 longer than data.max_length=32 and dropped, 1 with no trained response)" in err
    assert not (tmp_path / "out" / "train_results.json").exists()


def test_output_dir_of_another_run_is_refused(tmp_path, capsys, tiny_own_dir):
    out = tmp_path / "out"
    out.mkdir()
    keep = out / "precious.txt"
    keep.write_text("mine")
    recipe = recipe_file(tmp_path, tiny_own_dir)
    assert "is not empty and not a run: it holds no recipe.yaml (precious.txt); choose another output.dir" in _bad(
        capsys, "train", recipe, "train.max_steps=2")
    # overwrite replaces only a run: following the advice of old (set output.overwrite=true) deleted precious.txt
    assert "is not an earlier run: it holds no recipe.yaml (precious.txt); nothing was removed" in _bad(
        capsys, "train", recipe, "train.max_steps=2", "output.overwrite=true")
    assert keep.read_text() == "mine" and sorted(p.name for p in out.iterdir()) == ["precious.txt"]

    keep.unlink()
    code, _, err = run_cli(capsys, "train", recipe, "train.max_steps=2")
    assert code == 0, err
    # a finished run of the same recipe is not retrained over silently either
    finished = (out / "model.safetensors").stat().st_mtime_ns
    assert "already holds a finished run of this recipe" in _bad(capsys, "train", recipe, "train.max_steps=2")
    assert (out / "model.safetensors").stat().st_mtime_ns == finished
    assert "holds a different run; choose another output.dir or set output.overwrite=true" in _bad(
        capsys, "train", recipe, "train.max_steps=3")
    (out / "eval").mkdir()  # what `eval RUN` writes into the run: replaced with it
    (out / "eval" / "eval_results.json").write_text("{}")
    code, _, err = run_cli(capsys, "train", recipe, "train.max_steps=3", "output.overwrite=true")
    assert code == 0, err
    assert "max_steps: 3" in (out / "recipe.yaml").read_text() and not list(tmp_path.glob(".out.replaced-*"))
    assert not (out / "eval").exists()

    # a file no run writes beside an earlier run's: refused, named
    (out / "notes.txt").write_text("mine")
    assert _bad(capsys, "train", recipe, "train.max_steps=2", "output.overwrite=true") == (
        f"error: output.overwrite: {out} holds an earlier run and also notes.txt, which no run writes: move those out of "
        "it to replace the run; nothing was removed")
    assert _bad(capsys, "train", recipe, "train.max_steps=4") == (
        f"error: output.dir: {out} holds another run and also notes.txt, which no run writes; choose another output.dir "
        "(or move those out and set output.overwrite=true)")
    (out / "notes.txt").unlink()

    # What an overwrite took when it matched names by extension: files the user added with a name like a run's
    # (notes.md, a script in runs/, a file in a checkpoint) and this very recipe's eval data; each refused, named
    from erniekit_lite.recipe import Source, load
    from erniekit_lite.train import rundir

    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    (out / "eval.jsonl").write_text((IDENTITY.read_text().splitlines()[0]) + "\n")
    with_eval = load(str(recipe), ["train.max_steps=2", "output.overwrite=true"])
    with_eval = with_eval.model_copy(update={"data": with_eval.data.model_copy(update={"eval": [Source(path=str(out / "eval.jsonl"))]})})
    with pytest.raises(UserError, match="^" + re.escape(f"output.overwrite: {out} is not an earlier run: it is or holds "
                                                        f"the data ({out}/eval.jsonl); nothing was removed")):
        rundir.check(rundir.target(with_eval))
    (out / "eval.jsonl").unlink()
    (out / "runs").mkdir()
    (out / "checkpoint-9").mkdir()
    for added in ("notes.md", "runs/analysis.py", "checkpoint-9/mine.txt"):
        (out / added).write_text("mine")
        assert f"also {added}, which no run writes: move those out of it to replace the run; nothing was removed" in _bad(
            capsys, "train", recipe, "train.max_steps=2", "output.overwrite=true")
        (out / added).unlink()
    (out / "README.md").write_text("# my notes\n")  # a README.md that is no model card is the user's
    assert "also README.md, which no run writes" in _bad(capsys, "train", recipe, "train.max_steps=2", "output.overwrite=true")
    (out / "runs").rmdir()
    (out / "checkpoint-9").rmdir()
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before  # nothing else was touched


def test_a_start_that_never_trained_leaves_nothing_that_blocks_the_next(tmp_path, capsys, tiny_own_dir):
    """A start refused by the workers, or stopped while loading, leaves only recipe.yaml (and progress.jsonl's start):
    not a run, so the corrected command takes the folder (it was refused as "a different run"). A folder with a
    trained step, or anything else in it, is still refused."""
    from erniekit_lite.recipe import load
    from erniekit_lite.train import rundir

    recipe = recipe_file(tmp_path, tiny_own_dir)
    out = tmp_path / "out"
    out.mkdir()
    # what the refused start's claim wrote: its resolved recipe (rundir._identity)
    (out / "recipe.yaml").write_text(rundir._identity(load(str(recipe), ["train.learning_rate=0.5"])))
    (out / "progress.jsonl").write_text('{"event": "start", "step": 0, "max_steps": 2}\n')
    code, stdout, err = run_cli(capsys, "train", recipe, "train.max_steps=2")
    assert code == 0, err
    assert f"output.dir: {out} held a start that never trained a step; taken for this run" in stdout
    assert (out / "train_results.json").is_file() and not list(tmp_path.glob(".out.replaced-*"))

    other = tmp_path / "other"
    other.mkdir()
    (other / "recipe.yaml").write_text((out / "recipe.yaml").read_text())
    (other / "progress.jsonl").write_text('{"event": "log", "step": 1}\n')  # it trained a step
    assert "holds a different run" in _bad(capsys, "train", recipe, "train.max_steps=3", f"output.dir={other}")


def test_a_folder_holding_the_users_own_recipe_is_never_taken_or_emptied(tmp_path, capsys):
    """A recipe of the user's saved in the folder its output.dir names (the commented quick start, copied) is no start
    that never trained: it was taken, the user's file replaced by the resolved recipe. Now train refuses in one line
    naming the file, with or without overwrite or --resume, and nothing changes; a start the run wrote is taken."""
    from erniekit_lite.recipe import load
    from erniekit_lite.train import rundir

    out = tmp_path / "out"
    out.mkdir()
    mine = out / "recipe.yaml"
    text = (ROOT / "erniekit_lite" / "recipes" / "quickstart.yaml").read_text().replace("dir: runs/quickstart", f"dir: {out}")
    mine.write_text(text)
    said = f"it holds {mine}, which no run wrote (a recipe of your own is never replaced)"
    assert _bad(capsys, "train", mine, "train.max_steps=4") == (
        f"error: output.dir: {out} is not empty and not a run: {said}; choose another output.dir")
    assert _bad(capsys, "train", mine, "train.max_steps=4", "output.overwrite=true") == (
        f"error: output.overwrite: {out} is not an earlier run: {said}; nothing was removed (choose another output.dir)")
    assert _bad(capsys, "train", mine, "--resume") == (
        f"error: output.dir: {out} is not a run this recipe can resume: {said}; choose another output.dir")
    (out / "progress.jsonl").write_text('{"event": "start", "step": 0, "max_steps": 4}\n')  # even beside a start's record
    assert not rundir.never_trained(out)
    assert [p.name for p in sorted(out.iterdir())] == ["progress.jsonl", "recipe.yaml"] and mine.read_text() == text
    assert not list(tmp_path.glob(".out.replaced-*"))
    # a copy of a run's recipe.yaml, edited, is the user's too; the run's own, as it wrote it, is a start to take
    recipe = load(str(mine), ["train.max_steps=4"])
    mine.write_text(rundir._identity(recipe).replace("max_steps: 4", "max_steps: 5"))
    assert not rundir.never_trained(out)
    mine.write_text(rundir._identity(recipe))
    assert rundir.never_trained(out) and rundir.check(rundir.target(recipe)) is True


def test_overwrite_replaces_a_finished_vl_run(tmp_path):
    """A VL run saves its image processor beside the model (train/run.py; merge, the processor's files): all of it a
    run's, which output.overwrite replaces (it was refused as files no run writes)."""
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import Ernie4_5_VLMoeImageProcessorPil

    from erniekit_lite.recipe import load
    from erniekit_lite.train import rundir

    out = tmp_path / "out"
    out.mkdir()
    (out / "recipe.yaml").write_text(rundir._identity(load("quickstart-vl", [f"output.dir={out}"])))
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "trainer_state.json", "train_results.json",
                 "processor_config.json", "video_preprocessor_config.json", "chat_template.json"):  # a processor's save
        (out / name).write_text("{}")
    Ernie4_5_VLMoeImageProcessorPil().save_pretrained(out)  # the image processor, as train/run.py saves it
    assert (out / "preprocessor_config.json").is_file()
    again = rundir.target(load("quickstart-vl", [f"output.dir={out}", "train.max_steps=3", "output.overwrite=true"]))
    assert rundir.not_a_run(out, again) is None
    assert rundir.check(again) is True  # claim moves it aside


def test_overwrite_never_takes_the_working_folder_the_model_or_the_data(tmp_path, capsys, tiny_own_dir, monkeypatch):
    import shutil

    model = tmp_path / "work" / "model"
    shutil.copytree(tiny_own_dir, model)
    monkeypatch.chdir(tmp_path / "work")
    recipe = recipe_file(tmp_path, model)
    err = _bad(capsys, "train", recipe, "output.dir=.", "output.overwrite=true")
    assert "is not an earlier run: it is or holds the working folder" in err
    assert "is or holds the model" in _bad(capsys, "train", recipe, f"output.dir={model}", "output.overwrite=true")
    assert (model / "config.json").is_file()


def test_an_overwritten_run_comes_back_when_the_new_one_fails_before_its_first_step(tmp_path, capsys, tiny_own_dir, monkeypatch):
    """The earlier run waits aside until the new run's first optimizer step: a failure before it (a stand-in: the
    trainer's train raising) puts it back whole; after a first step it is gone."""
    from erniekit_lite.train import callbacks

    recipe = recipe_file(tmp_path, tiny_own_dir)
    assert run_cli(capsys, "train", recipe, "train.max_steps=2")[0] == 0
    out = tmp_path / "out"
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    def fails(*args, **kwargs):
        raise RuntimeError("stand-in: the run failed before its first step")

    monkeypatch.setattr(callbacks, "train", fails)
    left = tmp_path / ".out.replaced-999999999-0123abcd"  # what an overwrite killed before its first step left
    (left / "checkpoint-5").mkdir(parents=True)
    capsys.readouterr()
    with pytest.raises(RuntimeError, match="stand-in"):
        main(["train", str(recipe), "train.max_steps=3", "output.overwrite=true"])
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert list(tmp_path.glob(".out.replaced-*")) == [left]  # named, never deleted
    assert (f"output.dir: {left} holds an earlier run that an overwrite moved aside and a killed run left there; to get "
            f"it back, move it to a new name (mv {left} {tmp_path / 'out-earlier'}), or delete it") in capsys.readouterr().out

    # a put-back that fails itself never hides the failure that called it, and says where the earlier run is
    rename = Path.rename

    def no_put_back(self, to):
        if self.name.startswith(".out.replaced-") and Path(to) == out:
            raise OSError("stand-in: the put-back failed")
        return rename(self, to)

    monkeypatch.setattr(Path, "rename", no_put_back)
    with pytest.raises(RuntimeError, match="stand-in: the run failed"):
        main(["train", str(recipe), "train.max_steps=3", "output.overwrite=true"])
    (aside,) = [p for p in tmp_path.glob(".out.replaced-*") if p != left]
    assert {p.name: p.read_bytes() for p in aside.iterdir() if p.is_file()} == before
    assert (f"output.overwrite: the run failed before its first step, and the earlier run could not be put back "
            f"(stand-in: the put-back failed); it is in {aside}: move it to {out} by hand") in capsys.readouterr().out


def test_eval_split_reports_eval_loss(tmp_path, capsys, tiny_own_dir):
    code, out, err = run_cli(capsys, "train", recipe_file(tmp_path, tiny_own_dir), "data.eval_split=0.2", "train.max_steps=2")
    assert code == 0, err
    results = json.loads((tmp_path / "out" / "train_results.json").read_text())
    assert results["eval_loss"] > 0
    assert "eval: 4 samples" in out  # 20% of 18


def test_fp16_on_cpu_is_a_clear_error(tmp_path, capsys, tiny_own_dir):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert "train.fp16: true needs a CUDA GPU" in _bad(capsys, "train", recipe_file(tmp_path, tiny_own_dir), "train.fp16=true")


@pytest.mark.parametrize("name", ["sft.yaml", "sft-lora.yaml", "dpo.yaml", "dpo-lora.yaml"])
def test_real_03b_recipes_validate_against_released_config(capsys, name):
    """The shipped 0.3B recipes, planned against the released config and tokenizer (no weights needed)."""
    from conftest import ERNIE_TOKENIZER_DIR

    if not ERNIE_TOKENIZER_DIR.is_dir():
        missing("the shared reference files", SHARED_HOW)
    recipe = ROOT / "recipes" / "ernie-4.5-0.3b" / name
    code, out, err = run_cli(capsys, "validate", recipe, f"model.path={ERNIE_TOKENIZER_DIR}", "train.bf16=false", *shared_data(recipe))
    assert code == 0, err
    assert "Ernie4_5ForCausalLM" in out and "360,748,032 parameters" in out
    if name.endswith("-lora.yaml"):
        # r=32 on q,k,v,o (1024->2048, 1024->256 x2, 2048->1024) and gate,up,down (1024<->3072) over 18 layers
        per_layer = 32 * ((1024 + 2048) + 2 * (1024 + 256) + (2048 + 1024) + 3 * (1024 + 3072))
        assert f"{18 * per_layer:,} trainable (LoRA r=32)" in out


def test_tiny_never_overwrites(tmp_path, capsys):
    target = tmp_path / "tiny"
    assert run_cli(capsys, "tiny", target, "--hidden-size", "32", "--layers", "1")[0] == 0
    before = (target / "model.safetensors").read_bytes()
    code, out, _ = run_cli(capsys, "tiny", target, "--hidden-size", "32", "--layers", "1")
    assert code == 0 and "kept the tiny dense" in out  # same settings: nothing to redo
    assert "is not empty" in _bad(capsys, "tiny", target, "--hidden-size", "64")
    assert (target / "model.safetensors").read_bytes() == before


def test_options_and_overrides_in_any_order(monkeypatch, capsys):
    """`train r.yaml --resume train.max_steps=12` was "unrecognized arguments: train.max_steps=12"."""
    import erniekit_lite.cli as cli

    seen = []
    monkeypatch.setattr(cli, "_train", lambda args: seen.append((args.recipe, args.overrides, args.resume, args.num_processes)))
    monkeypatch.setattr(cli, "_eval", lambda args: seen.append((args.target, args.data, args.generate)))
    orders = [
        ["train", "r.yaml", "--resume", "train.max_steps=12", "a.b=1", "--num-processes", "2"],
        ["train", "--resume", "r.yaml", "train.max_steps=12", "--num-processes", "2", "a.b=1"],
        ["train", "--num-processes=2", "r.yaml", "train.max_steps=12", "a.b=1", "--resume"],
    ]
    for argv in orders:
        assert main(argv) == 0
    assert seen == [("r.yaml", ["train.max_steps=12", "a.b=1"], True, 2)] * len(orders)
    seen.clear()
    assert main(["eval", "--generate", "out/run", "--data", "d.jsonl"]) == 0
    assert seen == [("out/run", "d.jsonl", True)]
    with pytest.raises(SystemExit) as e:  # argparse's own errors still come first
        main(["trian", "r.yaml"])
    assert e.value.code == 2 and "invalid choice: 'trian'" in capsys.readouterr().err


@pytest.mark.parametrize("hub", ["offline", "unreachable"])
@pytest.mark.parametrize("command", ["train", "validate"])
def test_quick_start_before_its_model_exists_says_so_in_one_line(tmp_path, capfd, monkeypatch, command, hub):
    """`train recipes/quickstart.yaml` before `erniekit-lite tiny runs/tiny-ernie`, with HF_HUB_OFFLINE set or with no
    network and HF_HUB_OFFLINE unset (here: a Hub endpoint that refuses connections): no such directory here, the Hub
    could not be reached, and the command that makes the model; one request, none of huggingface_hub's retries."""
    import time

    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", hub == "offline")
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.chdir(tmp_path)  # runs/tiny-ernie does not exist here
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
    started = time.monotonic()
    code = main([command, str(recipe), f"output.dir={tmp_path / 'out'}"])
    assert time.monotonic() - started < 10  # from_pretrained's retries take about 23 s a file
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == ["error: model.path: runs/tiny-ernie: no such directory here, and the Hugging Face Hub could not be reached "
                   "to look for a repo of that name; the quick start's tiny model is made by "
                   "`erniekit-lite tiny runs/tiny-ernie --arch dense`"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("path", ["/nonexistent/model", "./nope", "a/b/c"])
def test_a_model_path_that_is_no_directory_and_no_hub_id_says_so_in_one_line(tmp_path, capfd, monkeypatch, path):
    """Not huggingface_hub's "Repo id must be in the form ...": where it was given, the path, no such folder."""
    monkeypatch.chdir(tmp_path)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
    code = main(["validate", str(recipe), f"model.path={path}", f"output.dir={tmp_path / 'out'}"])
    assert code == 2
    assert capfd.readouterr().err.strip().splitlines() == [
        f"error: override 'model.path={path}': model.path: {path}: no such folder (relative paths are resolved from the "
        "working directory)"]


def test_a_path_typo_is_said_at_its_recipe_line_with_the_name_beside_it(tmp_path, capsys, monkeypatch):
    """A local model.path or data path that is not there: its file:line and the closest name beside it, before
    anything heavy loads (they were answered about the Hub, or as "file not found" without the line); a Hub id (ORG/
    NAME, its ORG not a folder here) is left to the Hub; an enum and a command-line choice get their did-you-mean."""
    from erniekit_lite import recipe as recipes

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "tiny-ernie").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "identity.jsonl").write_text("{}\n")
    text = "model:\n  path: {model}\ndata:\n  train:\n    - path: {data}\noutput:\n  dir: runs/out\n"
    (tmp_path / "r.yaml").write_text(text.format(model="runs/tiny-erni", data="data/identity.jsonl"))
    for command in ("validate", "train"):
        assert _bad(capsys, command, "r.yaml") == "error: r.yaml:2: model.path: runs/tiny-erni: no such folder; did you mean runs/tiny-ernie?"
    (tmp_path / "r.yaml").write_text(text.format(model="runs/tiny-ernie", data="data/identiy.jsonl"))
    assert _bad(capsys, "validate", "r.yaml") == ("error: r.yaml:5: data.train.0.path: data/identiy.jsonl: no such file; did you "
                                                  "mean data/identity.jsonl?")
    assert _bad(capsys, "validate", "r.yaml", "data.train=[identity.jsonl]") == (
        "error: override 'data.train=[identity.jsonl]': data.train.0.path: identity.jsonl: no such file (relative paths are "
        "resolved from the working directory)")
    for hub in ("baidu/ERNIE-4.5-0.3B-PT", "someone/chats"):  # left to the Hub (its own one-line answers)
        recipes.check_local_paths(recipes.load(str(tmp_path / "r.yaml"), [f"model.path={hub}", f"data.train=[{hub}]"]))
    assert not (tmp_path / "runs" / "out").exists()
    with pytest.raises(SystemExit) as done:
        main(["tiny", "x", "--arch", "dnse"])
    assert done.value.code == 2 and capsys.readouterr().err.splitlines() == [
        "error: erniekit-lite tiny: argument --arch: invalid choice: 'dnse' (choose from 'dense', 'moe', 'vl'); did you mean "
        "'dense'? (`erniekit-lite tiny --help` says more)"]


def test_what_a_sharded_launch_cannot_run_is_refused_before_any_process_starts(tmp_path, capsys, tiny_own_dir):
    """FSDP with distributed.sync, with train.ema, with train.offload: optimizer; DeepSpeed with train.offload: each one
    line, exit 2, from `validate --num-processes 2 --accelerate-config F` and from `train` with the same options,
    before a process is launched (nothing claimed); without the sharding config `validate` passes them."""
    fsdp = Path(__file__).resolve().parents[1] / "erniekit_lite" / "recipes" / "accelerate" / "fsdp2.yaml"
    zero = tmp_path / "zero.yaml"
    zero.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\nmixed_precision: 'no'\n")
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}')
    zero_file = tmp_path / "zero-file.yaml"  # ZeRO-3 said in a DeepSpeed JSON the accelerate config names
    zero_file.write_text(f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {tmp_path / 'ds.json'}\n")
    path = write_recipe(tmp_path / "r.yaml", tiny_own_dir, train={"max_steps": 1})
    cases = [(fsdp, "distributed.sync=bf16", "distributed.sync: bf16 changes how DDP synchronises, and this run shards with FSDP"),
             (fsdp, "train.ema.decay=0.99", "train.ema: the parameters are sharded across processes (FSDP, ZeRO-3)"),
             (zero, "train.ema.decay=0.99", "train.ema: the parameters are sharded across processes (FSDP, ZeRO-3)"),
             (zero_file, "train.ema.decay=0.99", "train.ema: the parameters are sharded across processes (FSDP, ZeRO-3)"),
             (fsdp, "train.offload=optimizer", "train.offload: optimizer: FSDP keeps the optimizer state with its shards"),
             (zero, "train.offload=optimizer", "train.offload: optimizer: DeepSpeed offloads through its own config")]
    for config, override, said in cases:
        for command in ("validate", "train"):
            code, out, err = run_cli(capsys, command, path, override, "--num-processes", "2", "--accelerate-config", config)
            assert code == 2 and err.startswith(f"error: {said}") and err.count("\n") == 1, (command, override, err)
        assert not (tmp_path / "out").exists()
    code, out, err = run_cli(capsys, "validate", path, "distributed.sync=bf16", "train.ema.decay=0.99")  # DDP: fine
    assert code == 0, err
    code, out, err = run_cli(capsys, "validate", path, "--num-processes", "2", "--accelerate-config", fsdp)
    assert code == 0 and "memory per device (estimate) under this launch, sharded over its 2 processes (FSDP): about " in out, err


def test_tiny_with_a_hub_tokenizer_takes_its_sentencepiece_file(tmp_path, ernie_tokenizer_dir):
    """`tiny --tokenizer ORG/NAME` copies the release's tokenizer.model too (what `export --to gguf` reads), from the
    Hub or, as here (offline), the Hugging Face cache: a stand-in cache holding the real tokenizer (its tokenizer.json,
    quick to load, and the release's tokenizer.model)."""
    from conftest import ERNIE_TOKENIZER_DIR

    repo = tmp_path / "hub" / "models--baidu--ERNIE-4.5-0.3B-Base-PT"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for file in [*ernie_tokenizer_dir.iterdir(), *(ERNIE_TOKENIZER_DIR / name for name in ("tokenizer.model", "config.json"))]:
        (snapshot / file.name).write_bytes(file.read_bytes())
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "erniekit_lite", "tiny", str(tmp_path / "tiny"), "--hidden-size", "32",
                           "--layers", "1", "--tokenizer", "baidu/ERNIE-4.5-0.3B-Base-PT"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "tiny" / "tokenizer.model").read_bytes() == (ERNIE_TOKENIZER_DIR / "tokenizer.model").read_bytes()


@pytest.mark.parametrize("given", [None, "ACTIVE"])
def test_cpu_threads_wait_passively_unless_the_environment_says(given):
    """The CLI sets OpenMP's passive wait before anything imports torch (a CPU shared with other jobs), and leaves a
    wait policy the user set alone; its effect on a busy CPU is measured in benchmarks/results-threads.txt."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | ({"OMP_WAIT_POLICY": given} if given else {})
    probe = ("import os, sys; from erniekit_lite.cli import main; before = 'torch' in sys.modules; main(['recipes']); "
             "print(os.environ['OMP_WAIT_POLICY'], before)")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1].split() == [given or "PASSIVE", "False"]  # torch not loaded before the CLI sets it


def test_mistakes_needing_no_model_are_answered_before_torch_loads(tmp_path, tiny_own_dir):
    """A folder holding another run, a data-path typo, a model-path typo and a sequence_parallel the heads do not take:
    `train` answers each in one line without
    importing torch (it waited 9-19 s for torch, transformers, TRL and peft first; the time is benchmarks/mistakes.py's)."""
    import subprocess
    import sys

    from erniekit_lite.recipe import load
    from erniekit_lite.train import rundir

    recipe = recipe_file(tmp_path, tiny_own_dir)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "recipe.yaml").write_text(rundir._identity(load(str(recipe), ["train.max_steps=99"])))
    (tmp_path / "out" / "progress.jsonl").write_text('{"event": "log", "step": 1}\n')  # it trained a step
    said = []
    for overrides in ([], ["data.train=[missing.jsonl]"], [f"model.path={tiny_own_dir}-x"], ["distributed.sequence_parallel=3"]):
        done = subprocess.run([sys.executable, "-c", "import sys\nfrom erniekit_lite.cli import main\ncode = main(sys.argv[1:])\n"
                               "print(code, 'torch' in sys.modules)", "train", str(recipe), *overrides],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.stdout.split() == ["2", "False"], (done.stdout, done.stderr)
        said.append(done.stderr.strip())
    assert said[0] == (f"error: output.dir: {tmp_path / 'out'} is not empty and holds a different run; choose another "
                       "output.dir or set output.overwrite=true to replace it")
    assert said[1].endswith("data.train.0.path: missing.jsonl: no such file (relative paths are resolved from the working directory)")
    assert said[2].endswith(f"model.path: {tiny_own_dir}-x: no such folder; did you mean {tiny_own_dir}?")
    assert said[3] == "error: distributed.sequence_parallel: 3 does not divide this model's 2 attention heads; it takes 2"
