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
