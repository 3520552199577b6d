"""The MoE router's z-loss and orthogonal loss (train/router_losses.py; `train.router_z_loss_coef`,
`train.router_orthogonal_loss_coef`, erniekit-lite's own `train:` keys): each equals its formula written out directly
(fp32, 1e-6 relative, value and gradient), the z-loss weighs every real token of an optimizer step equally however
the step is cut into micro-batches, coefficients 0 train exactly as without the keys, and the keys are checked as
recipe keys are.
"""

from __future__ import annotations

import collections
import json
from types import SimpleNamespace

import pytest
import torch

from erniekit_lite.cli import main
from erniekit_lite.errors import RecipeError
from erniekit_lite.model.load import load_model
from erniekit_lite.train.router_losses import RouterLosses, orthogonal_loss, routers, z_loss_sum
from helpers import write_recipe

RTOL = 1e-6


def direct_z(router_logits, mask) -> torch.Tensor:
    """Σ over layers and real tokens of log(Σ_e exp(logit_e))², token by token."""
    total = torch.zeros((), dtype=torch.float64)
    keep = mask.reshape(-1).tolist()
    for logits in router_logits:
        for row, real in zip(logits.double(), keep):
            if real:
                total = total + torch.log(torch.exp(row).sum()) ** 2
    return total


def direct_orthogonal(weights) -> torch.Tensor:
    """Σ over routers of Σ_ij (ŵ_i·ŵ_j − δ_ij)² / E², ŵ_i = w_i / max(|w_i|, 1e-12)."""
    total = torch.zeros((), dtype=torch.float64)
    for weight in weights:
        rows = [w / torch.clamp(w.norm(), min=1e-12) for w in weight.double()]
        n = len(rows)
        total = total + sum((rows[i] @ rows[j] - (1.0 if i == j else 0.0)) ** 2 for i in range(n) for j in range(n)) / n**2
    return total


def assert_close(got, want, what):
    assert abs(got.item() - want.item()) <= RTOL * abs(want.item()), (what, got.item(), want.item())


def test_each_loss_and_its_gradient_equal_the_formula(tiny_moe_dir):
    """A padded batch (the second row's last 5 positions are padding): the z-loss counts real tokens only."""
    model = load_model(str(tiny_moe_dir), "float32", "sdpa")
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    weights = routers(model)
    assert len(weights) == 2 and weights[0].shape == (8, 64)  # the tiny MoE's two MoE layers, 8 experts
    for name, ours, direct in (
        ("z", lambda: z_loss_sum(model(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits, mask),
         lambda: direct_z(model(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits, mask)),
        ("orthogonal", lambda: orthogonal_loss(weights), lambda: direct_orthogonal(weights)),
    ):
        results = []
        for compute in (ours, direct):
            model.zero_grad()
            value = compute()
            value.backward()
            results.append((value.detach(), [w.grad.clone() for w in weights]))
        (value, grads), (want, want_grads) = results
        assert_close(value, want, name)
        for grad, want_grad in zip(grads, want_grads):
            assert want_grad.abs().max() > 0
            assert (grad.double() - want_grad.double()).abs().max() <= RTOL * want_grad.abs().max(), name


def test_the_z_loss_weighs_every_real_token_of_the_step_equally():
    """Two micro-batches of 10 and 30 real tokens in one step: their terms add up to the step's mean over 40 tokens
    (not the mean of the two micro-batch means); the orthogonal loss is added once per step in all."""

    router, logged, generator = RouterLosses(0.01, 0.1), collections.defaultdict(list), torch.Generator().manual_seed(0)
    batches = [[torch.randn(n, 8, generator=generator) * 3 for _ in range(2)] for n in (10, 30)]
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].mlp = torch.nn.Module()
    model.layers[0].mlp.gate = torch.nn.Linear(4, 8, bias=False)
    router.step_real = 40
    added = sum(router.terms(model, SimpleNamespace(router_logits=b), None, b[0].shape[0], 2, logged, 1) for b in batches)
    z = [z_loss_sum(b) for b in batches]
    want = 0.01 * (z[0] + z[1]) / 40 + 0.1 * orthogonal_loss(routers(model))
    assert_close(added, want, "step")
    assert abs(added.item() - (0.01 * (z[0] / 10 + z[1] / 30) / 2 + 0.1 * orthogonal_loss(routers(model))).item()) > 1e-3
    assert [len(logged[k]) for k in ("z_loss", "orthogonal_loss")] == [2, 2]


def losses(out) -> list[dict]:
    return [h for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]


def test_a_run_trains_and_logs_each_and_coefficients_0_change_nothing(tmp_path, tiny_moe_dir):
    runs = {"without": {}, "zero": {"router_z_loss_coef": 0, "router_orthogonal_loss_coef": 0.0},
            "both": {"router_z_loss_coef": 0.01, "router_orthogonal_loss_coef": 0.1}}
    logged = {}
    for name, keys in runs.items():
        recipe = write_recipe(tmp_path / f"{name}.yaml", tiny_moe_dir, out=tmp_path / name,
                              train={"max_steps": 2, "logging_steps": 1, "save_strategy": "no", "learning_rate": 1e-3,
                                     "per_device_train_batch_size": 1, **keys})
        assert main(["train", str(recipe)]) == 0
        logged[name] = losses(tmp_path / name)
    assert [h["loss"] for h in logged["zero"]] == [h["loss"] for h in logged["without"]]
    assert not any("z_loss" in h or "orthogonal_loss" in h for h in logged["zero"])
    for step, (with_losses, without) in enumerate(zip(logged["both"], logged["without"])):
        assert with_losses["z_loss"] > 0 and with_losses["orthogonal_loss"] > 0, step
        assert with_losses["loss"] > without["loss"], step  # both terms are positive


def test_the_keys_are_checked_as_recipe_keys(tmp_path, tiny_own_dir, tiny_moe_dir, capsys):
    from erniekit_lite import recipe as recipes
    from erniekit_lite.trainer_args import training_args

    def load(**changes):
        return recipes.load(write_recipe(tmp_path / "r.yaml", tiny_own_dir, **changes))

    cases = [
        ({"train__router_z_los_coef": 0.1}, "unknown key 'router_z_los_coef' in train; did you mean 'router_z_loss_coef'?"),
        ({"method": "dpo", "train__router_z_loss_coef": 0.1}, "train.router_z_loss_coef: method dpo does not take it (methods that do: sft, pt)"),
        ({"train__router_z_loss_coef": -1}, "train.router_z_loss_coef: expected a number >= 0 (got -1)"),
        ({"lora": {"r": 4}, "train__router_orthogonal_loss_coef": 0.1},
         "train.router_orthogonal_loss_coef: LoRA leaves the MoE router frozen, and this loss depends on its weight alone; "
         "remove it or train without lora:"),
    ]
    for changes, message in cases:
        with pytest.raises(RecipeError) as error:
            load(**changes)
        assert str(error.value).endswith(message), str(error.value)
    recipe = load(lora={"r": 4}, train__router_z_loss_coef="1e-3")  # the z-loss reaches adapters through the router's inputs
    assert recipe.train["router_z_loss_coef"] == 0.001
    assert not hasattr(training_args(recipe, tmp_path / "out"), "router_z_loss_coef")  # not TRL's
    assert main(["train", str(write_recipe(tmp_path / "d.yaml", tiny_own_dir, train={"router_z_loss_coef": 0.1}))]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("train.router_z_loss_coef is for an MoE model (ERNIE-4.5-21B-A3B's expert router); "
                            f"{tiny_own_dir} is a dense model: remove it"), err
    recipe = write_recipe(tmp_path / "m.yaml", tiny_moe_dir, train={"router_z_loss_coef": 0.01})
    assert main(["validate", str(recipe)]) == 0
    assert ("moe: router z-loss coefficient 0.01, logged as z_loss, orthogonal loss off (train.router_z_loss_coef, "
            "train.router_orthogonal_loss_coef)") in capsys.readouterr().out.splitlines()


def test_a_multi_process_step_gathers_the_token_count_only_for_the_z_loss():
    """The step's real tokens are gathered across processes (a collective, and a tensor made from a host int) only
    when the z-loss divides by them; with its coefficient 0 an SFT/PT step of several processes makes no gather for it.
    Only the step's count (`RouterLosses.count_step`, which the SFT trainer's `_get_num_items_in_batch` calls) runs
    here, over a stand-in accelerator's counting `gather`."""
    from types import SimpleNamespace

    gathered = []
    args = SimpleNamespace(average_tokens_across_devices=True, world_size=2)
    accelerator = SimpleNamespace(gather=lambda t: gathered.append(t) or torch.cat([t, t]))
    router = RouterLosses()
    batches = [{"real_tokens": 5}, {"real_tokens": 7}]
    router.count_step(batches, args, accelerator, "cpu")
    assert gathered == [] and router.step_real == 12
    router.z_coef = 1e-3
    router.count_step(batches, args, accelerator, "cpu")
    assert len(gathered) == 1 and float(router.step_real) == 24.0  # both processes' counts
