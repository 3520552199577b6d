"""`train.offload` (docs/offload.md): the plan proposes it, the run applies it.

On CPU over gloo, 2 processes: `optimizer` (the host step under DDP) trains exactly as DDP without it, `parameters`
(FSDP2's CPU offload, launched by `train` itself) as DDP within FSDP2's tolerance, and each resumes exactly: a run of
2 steps, extended by `--resume train.max_steps=4`, logs DDP's 4 steps. Here the host is the device, so what is
measured is what the offloaded state holds (the storage of the host step's tensors, of FSDP2's local shards), against
the plan's `host memory`; the GPU side (a memory cap below the plan) needs a GPU.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from erniekit_lite import memory, plan, run_plan
from erniekit_lite.errors import UserError
from erniekit_lite.recipe import RecipeError, load
from conftest import SHARED, SHARED_HOW, needs
from helpers import write_recipe
from test_distributed import train_cli, write_data


def recipe(tmp_path: Path, model_dir: Path, offload: str, **train) -> Path:
    train = {"learning_rate": 2e-3, "max_steps": 4, "per_device_train_batch_size": 1, "logging_steps": 1, "save_steps": 2,
             "activation_checkpointing": False, "seed": 0, "lr_scheduler_type": "constant", "offload": offload, **train}
    return write_recipe(tmp_path / f"{offload}.yaml", model_dir, data={"train": [str(write_data(tmp_path / "data.jsonl"))], "max_length": 64},
                        out=tmp_path / offload, output={"sample_prompts": []}, train=train)


def history(out: Path) -> tuple[list[int], list[float]]:
    """The logged steps, and each step's loss and gradient norm in one list."""
    logs = [h for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    return [h["step"] for h in logs], [v for h in logs for v in (h["loss"], h["grad_norm"])]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, tiny_own_dir):
    """The reference: 2-process DDP, full fine-tuning in fp32, 4 steps at a constant learning rate."""
    where = tmp_path_factory.mktemp("ddp")
    done = train_cli(where, str(recipe(where, tiny_own_dir, "none")), "--num-processes", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    return history(where / "none")


@pytest.mark.slow  # two launches of 2 processes per mode (~25 s on 2 idle cores), one DDP launch shared
@pytest.mark.parametrize("mode", ["optimizer", "parameters"])
def test_two_processes_train_with_offload_and_resume_exactly(tmp_path, tiny_own_dir, ddp, mode):
    """2 steps, then `--resume train.max_steps=4`: the 4 steps equal DDP's without offload (the host step's fp32
    arithmetic is the same AdamW's: exactly; FSDP2's reduce-scatter sums in another order: within 1e-5). The run says
    what it offloads, FSDP2's model state holds the CPU offload policy, and the bytes the offloaded state holds in
    each process are the plan's host memory (the host step's exactly; FSDP2's shards padded to even sizes: within 1%)."""
    path, out = recipe(tmp_path, tiny_own_dir, mode, max_steps=2), tmp_path / mode
    launch = ["--num-processes", "2"]  # parameters: no accelerate config, `train` launches FSDP2 itself
    first = train_cli(tmp_path, str(path), *launch)
    assert first.returncode == 0, first.stderr[-4000:]
    assert first.stdout.count(f"train.offload: {mode}: in host memory {memory.HOST_HELD[mode]}") == 1
    resumed = train_cli(tmp_path, str(path), "train.max_steps=4", "--resume", *launch)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resuming from {out / 'checkpoint-2'}" in resumed.stdout

    (steps, got), (ddp_steps, ref) = history(out), ddp
    assert steps == ddp_steps == [1, 2, 3, 4]
    assert got == pytest.approx(ref, rel=1e-6) if mode == "optimizer" else got == pytest.approx(ref, abs=1e-5)
    report = json.loads((out / "train_results.json").read_text())["distributed"]
    assert report["offload"] == mode and report["world_size"] == 2
    assert report["strategy"] == ("DDP" if mode == "optimizer" else "FSDP2")
    held, planned = report["offload_host_bytes"], report["offload_host_bytes_planned"]
    if mode == "optimizer":  # per trainable parameter: fp32 master, gradient copy and AdamW's two states
        assert held == planned == 16 * report["parameters"]
    else:
        assert report["offload_policy"] == "CPUOffloadPolicy" and report["sharded_parameters"] == report["parameters"]
        assert planned == pytest.approx(held, rel=0.01) and held < 16 * report["parameters"]  # half of it, padded


def test_host_step_keeps_the_groups_and_resumes_bf16_weights_from_fp32_masters():
    """The host step around torch's AdamW with two groups at different rates (as LoRA+ builds them) updates fp32
    parameters exactly as AdamW itself; bf16 parameters are their fp32 masters rounded, and a host step built afresh
    from its state dict (the masters in it) continues exactly."""
    import copy

    import torch

    from erniekit_lite.train.offload import HostStep

    torch.manual_seed(0)
    shapes = [(4, 3), (5,)]
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(4)]
    groups = lambda ps: [{"params": [ps[0]], "lr": 1e-2}, {"params": [ps[1]], "lr": 1e-1}]  # noqa: E731

    def run(optimizer, params, steps):
        for g in steps:
            for p, gi in zip(params, g):
                p.grad = gi.to(p.dtype)
            optimizer.step()

    plain, hosted = ([torch.nn.Parameter(t.clone()) for t in start] for _ in range(2))
    run(torch.optim.AdamW(groups(plain)), plain, grads)
    run(HostStep(torch.optim.AdamW(groups(hosted))), hosted, grads)
    assert all(torch.equal(a, b) for a, b in zip(plain, hosted))

    bf16 = [torch.nn.Parameter(t.to(torch.bfloat16)) for t in start]
    step = HostStep(torch.optim.AdamW(groups(bf16)))
    run(step, bf16, grads[:2])
    masters = [m for _, m, _ in step.pairs]
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(bf16, masters)) and not torch.equal(masters[0].to(torch.bfloat16).float(), masters[0])
    state = copy.deepcopy(step.state_dict())  # as saved: the live state tensors are not shared
    again = [torch.nn.Parameter(p.detach().clone()) for p in bf16]  # what a checkpoint holds: the bf16 weights
    resumed = HostStep(torch.optim.AdamW(groups(again)))
    resumed.load_state_dict(state)
    run(step, bf16, grads[2:])
    run(resumed, again, grads[2:])
    assert all(torch.equal(a, b) for a, b in zip(bf16, again))


def test_the_guard_checks_the_host_steps_norm_after_its_one_wait():
    """Under the host step the divergence guard reads no norm itself: the norm rides to the host with the gradients
    and is checked in `step` before anything is applied (a finite one steps; a non-finite one stops the run with the
    weights and the optimizer's state untouched)."""
    import torch

    from erniekit_lite.train.checkpoints import Diverged, DivergenceGuard
    from erniekit_lite.train.offload import HostStep

    param = torch.nn.Parameter(torch.ones(3))
    step, guard = HostStep(torch.optim.AdamW([param], lr=0.1)), DivergenceGuard()
    guard.last_loss = torch.tensor(2.0)
    reads = []

    class Norm(torch.Tensor):  # a norm that says when it is read as a number
        def __float__(self):
            reads.append(1)
            return super().__float__()

    param.grad = torch.full((3,), 0.5)
    finite = torch.tensor(0.8).as_subclass(Norm)
    assert guard.norm(finite, step, step=1, apart=False) is finite and reads == []
    step.step()
    assert reads == [] and not torch.equal(param.detach(), torch.ones(3))
    before, state = param.detach().clone(), {k: v.clone() for k, v in step.state[step.pairs[0][1]].items()}
    guard.norm(torch.tensor(float("inf")).as_subclass(Norm), step, step=2, apart=False)
    param.grad = torch.full((3,), float("inf"))
    with pytest.raises(Diverged, match="step 2: gradient norm inf, loss 2.0"):
        step.step()
    assert reads == [] and torch.equal(param.detach(), before)
    assert all(torch.equal(v, state[k]) for k, v in step.state[step.pairs[0][1]].items())


def test_offload_refused_in_one_line_where_it_cannot_apply(tmp_path, tiny_own_dir, monkeypatch, capsys):
    """A 4-bit base, local SGD and an unknown mode are refused by the recipe check, naming the key; a run whose
    offloaded state would not fit the host by `train`, before the model loads; a bitsandbytes optimizer, optimizer
    offload under FSDP and any under DeepSpeed by the worker; a DeepSpeed config with parameters by the launcher."""
    from erniekit_lite.cli import main
    from erniekit_lite.launch import launch_command
    from erniekit_lite.trainer_args import training_args

    path = recipe(tmp_path, tiny_own_dir, "optimizer")
    with pytest.raises(RecipeError, match=r"optimizer.yaml:\d+: train.offload: optimizer with model.load_in_4bit"):
        load(path, ["model.load_in_4bit=true", "lora.r=4"])
    with pytest.raises(RecipeError, match="train.offload: optimizer steps the optimizer on host copies"):
        load(path, ["distributed.sync=local_sgd", "train.save_steps=8"])
    with pytest.raises(RecipeError, match=r"train.offload: expected one of none, optimizer, parameters, auto \(got 'cpu'\)"):
        load(path, ["train.offload=cpu"])

    monkeypatch.setattr(plan, "host_available", lambda: 10**6)  # 1 MB free: the host step's 2.2 MB does not fit
    monkeypatch.setattr(run_plan, "host_available", lambda: 10**6)
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "train.offload: optimizer needs about 2.1 MiB of host memory per process (1 on this machine), and 1.0 MiB is available" in err
    assert err.count("\n") == 1 and not (tmp_path / "optimizer").exists()  # nothing claimed

    with pytest.raises(UserError, match="train.optim adamw_bnb_8bit is not one: use adamw_torch_fused"):
        r = load(path, ["train.optim=adamw_bnb_8bit"])
        run_plan.resolve_offload(r, training_args(r, tmp_path), None, 0, print, True, "plain")
    for env, mode, said in ((("ACCELERATE_USE_FSDP", "true"), "optimizer", "use train.offload: parameters"),
                            (("ACCELERATE_USE_DEEPSPEED", "true"), "parameters", "DeepSpeed offloads through its own config"),
                            (("ACCELERATE_USE_FSDP", "false"), "parameters", "runs under FSDP2, which `erniekit-lite train` launches")):
        monkeypatch.setenv(*env)
        with pytest.raises(UserError, match=said):
            run_plan.refuse_unlaunchable(load(path, [f"train.offload={mode}"]), run_plan.Launch(run_plan.strategy(), 2))
        monkeypatch.delenv(env[0])
    config = tmp_path / "zero.yaml"
    config.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n")
    with pytest.raises(UserError, match="train.offload: parameters runs under FSDP2, and .*zero.yaml is a DeepSpeed config"):
        launch_command(str(path), ["train.offload=parameters"], 2, str(config), offload_parameters=True)


def test_auto_takes_the_first_mode_that_fits_the_device_and_the_host(tmp_path, tiny_own_dir):
    """`auto`'s choice (run_plan.choose_offload, what `train` runs on its GPU's free memory): none when the plan fits 85%
    of the device, optimizer when only it does, and the last one tried when the host cannot hold the one that fits;
    on a machine without a GPU `train` resolves auto to none and says so."""
    from erniekit_lite.run_plan import architecture, memory_estimate
    from erniekit_lite.train import offload
    from erniekit_lite.trainer_args import training_args

    r = load(recipe(tmp_path, tiny_own_dir, "auto"))
    args, arch = training_args(r, tmp_path / "auto"), architecture(str(tiny_own_dir), r)
    none, _ = memory_estimate(r, args, arch, cuda=True)
    opt, _ = memory_estimate(r, args, arch, cuda=True, offload="optimizer")
    assert opt.total < none.total and opt.host == 16 * arch["trainable"] and none.host == 0
    choose = lambda device, host: run_plan.choose_offload(r, args, arch, device, host, ("none", "optimizer"))[0]  # noqa: E731
    assert choose(int(none.total / 0.85) + 1, 0) == "none"
    squeezed = int(opt.total / 0.85) + 1  # fits with the optimizer state on the host, not without
    assert squeezed < none.total / 0.85
    assert choose(squeezed, opt.host) == "optimizer"
    assert choose(squeezed, opt.host - 1) == "optimizer"  # the last tried: train's host check then refuses it
    said = []
    assert run_plan.resolve_offload(r, args, arch, squeezed, said.append, cuda=False, how="plain") == run_plan.Applied("none", 0)
    assert offload.applied(args).mode == "none"
    assert said == ["train.offload: auto: none (no GPU: everything is in host memory already)"]


@needs((SHARED / "ernie45" / "ernie-4.5-21b-a3b-pt").is_dir(), "the shared 21B-A3B config", SHARED_HOW)
def test_validate_proposes_the_offload_that_fits_with_its_host_memory(tmp_path):
    """ERNIE-4.5-21B-A3B LoRA in bf16 (43 GB of weights) does not fit a 24 GB GPU (what validate plans for without a
    GPU): optimizer offload does not help (LoRA's states are small), parameter offload does; validate says both, with
    the host memory each needs and whether this machine has it, and prints the plan with parameters."""
    from erniekit_lite.plan import plan as validate

    config = tmp_path / "21b"
    config.mkdir()
    (config / "config.json").write_text((SHARED / "ernie45" / "ernie-4.5-21b-a3b-pt" / "config.json").read_text())
    path = write_recipe(tmp_path / "r.yaml", config, lora={"r": 8, "alpha": 16}, model={"dtype": "bfloat16"},
                        data={"max_length": 2048}, train={"per_device_train_batch_size": 1})
    lines = []
    info = validate(load(path), log=lines.append)
    text = "\n".join(lines)
    assert info["offload"] == "none" and info["memory_gb"] > 24 * 0.85
    assert info["offload_proposed"] == "parameters"
    # the GPU it does not fit named once (it was said again for each mode), then a line per mode
    (note,) = [i for i, line in enumerate(lines) if "does not fit a 24 GB GPU" in line]
    assert lines[note].startswith("note: the plan (") and lines[note].endswith(
        "does not fit a 24 GB GPU (the smallest GPU validate names, as no GPU is here); what each train.offload would need there:")
    optimizer, parameters = lines[note + 1:note + 3]
    assert optimizer.startswith("  train.offload: optimizer: ") and "(does not fit either)" in optimizer
    assert parameters.startswith("  train.offload: parameters (one FSDP2 process") and "on the device (fits)" in parameters
    assert "host memory: " in parameters and "this machine has" in parameters
    assert "with train.offload: parameters:\n  memory per device (estimate):" in text
    assert "  host memory (train.offload: parameters): " in text

    lines.clear()  # auto without a GPU: none here, as `train` takes it here; what it takes on each GPU size, named
    info = validate(load(path, ["train.offload=auto"]), log=lines.append)
    (auto,) = [line for line in lines if line.startswith("train.offload: auto:")]
    assert auto.startswith("train.offload: auto: none on this machine (no GPU); on a GPU `train` takes the first of none "
                           "and optimizer that fits it: ") and auto.endswith("; the plan below is with none")
    assert "neither fits a 24 GB" in auto and info["offload"] == "none" and info["offload_proposed"] == "parameters"

    lines.clear()  # offload set: the plan with it, its host memory and whether this machine has it, no proposal
    info = validate(load(path, ["train.offload=parameters"]), log=lines.append)
    assert info["offload"] == "parameters" and "offload_proposed" not in info and info["memory_gb"] < 24 * 0.85
    (host,) = [line for line in lines if line.startswith("  host memory: ")]
    said = re.fullmatch(r"  host memory: ([\d.]+) GiB per process; this machine has [\d.]+ [GM]iB available "
                        r"\((fits|does not fit: `train` would refuse here)\)", host)
    assert said and float(said.group(1)) == pytest.approx(info["host_memory_gb"], abs=0.05) and info["host_memory_gb"] > 24
