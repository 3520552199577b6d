"""`merge` copies the base's tensors that the model class does not load (the released 21B-A3B's multi-token-prediction
block, `model.mtp_*`, which transformers skips and vLLM's `ernie_mtp` reads) into the merged model unchanged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from erniekit_lite.model.merge import CARRIED, INDEX
from helpers import run_cli, write_recipe


def released_layout_with_mtp(tiny_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """`tiny_dir` rewritten as the released checkpoints are laid out: two shards and an index, the second holding an
    MTP block named as in the released index (`model.mtp_emb_norm.0`, `model.mtp_hidden_norm.0`,
    `model.mtp_linear_proj.0`, and `model.mtp_block.0.*`: a decoder layer shaped as the last one). Returns the MTP tensors."""
    shutil.copytree(tiny_dir, out)
    weights = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    config = json.loads((out / "config.json").read_text())
    hidden, last = config["hidden_size"], config["num_hidden_layers"] - 1
    generator = torch.Generator().manual_seed(7)
    random = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    mtp = {"model.mtp_emb_norm.0.weight": random(hidden), "model.mtp_hidden_norm.0.weight": random(hidden),
           "model.mtp_linear_proj.0.weight": random(hidden, 2 * hidden)}
    prefix = f"model.layers.{last}."
    mtp |= {"model.mtp_block.0." + name[len(prefix):]: random(*t.shape) for name, t in weights.items() if name.startswith(prefix)}
    save_file(weights, out / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(mtp, out / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = dict.fromkeys(weights, "model-00001-of-00002.safetensors") | dict.fromkeys(mtp, "model-00002-of-00002.safetensors")
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return mtp


def lora_run(tmp: Path, base: Path, capsys) -> Path:
    recipe = write_recipe(tmp / "r.yaml", base, lora={"r": 4, "alpha": 8}, out=tmp / "run",
                          train={"learning_rate": 1e-2, "max_steps": 2, "per_device_train_batch_size": 2, "activation_checkpointing": False})
    assert run_cli(capsys, "train", recipe)[0] == 0
    return tmp / "run"


@pytest.mark.slow
def test_mtp_tensors_survive_a_merge(tmp_path, capsys, tiny_moe_dir):
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    mtp = released_layout_with_mtp(tiny_moe_dir, base)
    assert any(".mlp.experts.0." in name for name in mtp) and len(mtp) > 10  # the MoE layer's experts too
    run = lora_run(tmp_path, base, capsys)
    code, out, err = run_cli(capsys, "merge", run, "--out", tmp_path / "merged")
    assert code == 0, err
    assert f"copied {len(mtp)} tensor(s) of the base that the model class does not load, unchanged, into {CARRIED}" in out

    merged = tmp_path / "merged"
    carried = load_file(merged / CARRIED)
    assert set(carried) == set(mtp)
    for name, tensor in mtp.items():
        assert torch.equal(carried[name], tensor), name
    # the index names every tensor of every shard, and each where it is
    index = json.loads((merged / INDEX).read_text())["weight_map"]
    stored = {}
    for path in merged.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            stored |= dict.fromkeys(f.keys(), path.name)
    assert index == stored
    assert json.loads((merged / "erniekit_merged.json").read_text())["carried_over"] == sorted(mtp)

    # the merged model still loads with transformers alone (the MTP names are unexpected keys there, as in the base)
    # and answers as the run does
    ids = torch.tensor([[5, 17, 42, 9, 3, 77]])
    with torch.no_grad():
        from erniekit_lite.model.load import load_model

        expected = load_model(str(run), "float32", "eager", trainable_adapter=False).eval()(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager").eval()(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5)


@pytest.mark.slow
def test_nothing_is_carried_when_the_model_loaded_everything(tmp_path, capsys, tiny_moe_dir):
    run = lora_run(tmp_path, tiny_moe_dir, capsys)
    code, out, err = run_cli(capsys, "merge", run, "--out", tmp_path / "merged")
    assert code == 0, err
    assert "copied" not in out and not (tmp_path / "merged" / CARRIED).exists()
    assert json.loads((tmp_path / "merged" / "erniekit_merged.json").read_text())["carried_over"] == []
