"""`train.ema` (train/ema.py): the EMA follows its formula, a resumed run's EMA is exactly an uninterrupted run's,
OUTPUT/ema is a run dir that loads (adapter or full model) and pushes, and the key is checked as recipe keys are.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from erniekit_lite.cli import main
from erniekit_lite.errors import RecipeError, UserError
from erniekit_lite.model.load import load_model
from erniekit_lite.train.ema import FILE, WeightEma
from helpers import IDENTITY, write_recipe


def test_the_ema_follows_its_formula():
    """The parameter itself until step `start`, then e <- e + (1 - D)(p - e) after each step, in fp32 for a bf16
    parameter; frozen parameters are not kept."""
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    model.weight.data = model.weight.data.to(torch.bfloat16)
    ema = WeightEma(decay=0.75, start=2)
    ema.on_train_begin(None, None, None, model=model)
    assert ema.names == ["weight"] and ema.ema[0].dtype == torch.float32
    want = model.weight.detach().float().clone()
    for step in range(1, 6):
        with torch.no_grad():
            model.weight.add_(0.5 * step)
        ema.on_step_end(None, SimpleNamespace(global_step=step), None)
        p = model.weight.detach().float()
        want = p.clone() if step <= 2 else want + 0.25 * (p - want)
        assert torch.allclose(ema.ema[0], want, rtol=0, atol=1e-6), step


def ema_recipe(tmp_path: Path, model_dir, name: str, lora: dict | None, **train) -> Path:
    return write_recipe(tmp_path / f"{name}.yaml", model_dir, lora=lora, out=tmp_path / name,
                        train={"learning_rate": 1e-2, "lr_scheduler_type": "constant", "per_device_train_batch_size": 1, "activation_checkpointing": False,
                               "logging_steps": 1, "save_steps": 2, "seed": 0, "ema": {"decay": 0.5, "start": 1}, **train})


def test_a_resumed_runs_ema_is_the_uninterrupted_runs_and_output_ema_loads(tmp_path, tiny_own_dir):
    """LoRA at a constant rate (so that max_steps changes no schedule): 4 steps straight, and 2 steps then resumed
    to 4: the same OUTPUT/ema adapter, bit for bit; each
    checkpoint holds ema.safetensors; OUTPUT/ema is an adapter run dir that loads and differs from OUTPUT."""
    whole = ema_recipe(tmp_path, tiny_own_dir, "whole", {"r": 4, "dropout": 0.0}, max_steps=4)
    assert main(["train", str(whole)]) == 0
    cut = ema_recipe(tmp_path, tiny_own_dir, "cut", {"r": 4, "dropout": 0.0}, max_steps=2)
    assert main(["train", str(cut)]) == 0
    assert main(["train", str(cut), "--resume", "train.max_steps=4"]) == 0
    for run in ("whole", "cut"):
        assert sorted(p.name for p in (tmp_path / run).glob("checkpoint-*/" + FILE)) == [FILE, FILE]
    ema = {run: load_file(str(tmp_path / run / "ema" / "adapter_model.safetensors")) for run in ("whole", "cut")}
    assert ema["whole"].keys() == ema["cut"].keys() and ema["whole"]
    for name in ema["whole"]:
        assert torch.equal(ema["whole"][name], ema["cut"][name]), name
    trained = load_file(str(tmp_path / "whole" / "adapter_model.safetensors"))
    assert any(not torch.equal(trained[n], ema["whole"][n]) for n in trained if "lora_B" in n)
    for name in ("recipe.yaml", "adapter_config.json", "tokenizer_config.json", "train_results.json", "trainer_state.json"):
        assert (tmp_path / "whole" / "ema" / name).is_file(), name
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert load_model(str(tmp_path / "whole" / "ema"), "float32", "sdpa")(input_ids=ids).logits.isfinite().all()


def test_full_fine_tuning_writes_a_model_folder(tmp_path, tiny_own_dir, capsys):
    """OUTPUT/ema holds a model folder and metrics of its own: evaluated on the run's eval data (the same eval_loss
    `erniekit-lite eval` computes for it), the EMA's settings and the run's facts, and no loss or loss curve of the
    trained weights (it copied their eval_loss and log_history)."""
    recipe = ema_recipe(tmp_path, tiny_own_dir, "full", None, max_steps=2, save_strategy="no")
    assert main(["validate", str(recipe)]) == 0
    assert "note: train.ema: an fp32 copy of the trained parameters, counted with the optimizer states" in capsys.readouterr().out
    assert main(["train", str(recipe), f"data.eval={IDENTITY}"]) == 0
    assert (tmp_path / "full" / "ema" / "model.safetensors").is_file()
    ema, trained = (load_file(str(tmp_path / "full" / d / "model.safetensors")) for d in ("ema", "."))
    assert ema.keys() == trained.keys() and any(not torch.equal(ema[n], trained[n]) for n in ema)
    load_model(str(tmp_path / "full" / "ema"), "float32", "sdpa")

    run, own = (json.loads((tmp_path / "full" / d / "train_results.json").read_text()) for d in (".", "ema"))
    assert "train_loss" not in own and (own["ema_decay"], own["ema_start"]) == (0.5, 1)
    assert own["train_tokens"] == run["train_tokens"] and own["eval_loss"] != run["eval_loss"]
    assert json.loads((tmp_path / "full" / "ema" / "trainer_state.json").read_text())["log_history"] == []
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "full" / "ema"), "--data", str(IDENTITY), "--out", str(tmp_path / "ema-eval.json")]) == 0
    assert own["eval_loss"] == pytest.approx(json.loads((tmp_path / "ema-eval.json").read_text())["eval_loss"], rel=1e-5)


def test_the_key_is_checked_and_sharded_parameters_are_refused(tmp_path, tiny_own_dir):
    """A sharded launch (FSDP, ZeRO-3) is refused with the EMA by the run plan, in one line, before any process starts."""
    from erniekit_lite import recipe as recipes

    cases = [
        (0.99, "train.ema: expected {decay: 0.999, start: 0} (got 0.99)"),
        ({"start": 3}, "train.ema: missing required key 'decay' (e.g. 0.999)"),
        ({"decay": 1.0}, "train.ema.decay: expected a number between 0 and 1, exclusive (got 1.0)"),
        ({"decay": 0.9, "strat": 3}, "unknown key 'strat' in train.ema; did you mean 'start'?"),
    ]
    for value, message in cases:
        with pytest.raises(RecipeError) as error:
            recipes.load(write_recipe(tmp_path / "r.yaml", tiny_own_dir, train={"ema": value}))
        assert str(error.value).endswith(message), str(error.value)
    recipe = recipes.load(write_recipe(tmp_path / "r.yaml", tiny_own_dir, method="dpo", train={"ema": {"decay": "9e-1"}}))
    assert recipe.train["ema"] == {"decay": 0.9, "start": 0}
    from erniekit_lite.run_plan import Launch, refuse_unlaunchable

    for launch in (Launch("fsdp", 2), Launch("deepspeed", 2, zero3=True)):  # the run plan's one refusal
        with pytest.raises(UserError, match=r"^train.ema: the parameters are sharded across processes \(FSDP, ZeRO-3\)"):
            refuse_unlaunchable(recipe, launch)
    refuse_unlaunchable(recipe, Launch("deepspeed", 2))  # ZeRO-1/2: each process holds the whole parameters
