"""More than one machine: `erniekit-lite train --num-machines 2 --machine-rank R --main-process-ip HOST ...`.

Tested on one box: two launchers on 127.0.0.1 act as two machines with one gloo process each, writing one run dir
(a shared filesystem). FSDP2 (the shipped config, fp32) on the tiny MoE: the run trains like one process with twice
the gradient accumulation, rank 0 alone writes the run dir, checkpoints are sharded (each machine writes its rank's
shard), SIGTERM to one machine stops both after the same step, and `--resume` on both continues exactly. A machine
whose partner never comes fails in one line naming the address and port it waited on.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from test_distributed import ROOT, events, fp32_config, history, step_losses, train_cli, write_data

MACHINES = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_flags(rank: int, port: int, processes: int = MACHINES) -> list[str]:
    """One machine's flags; `processes` is the total over both machines."""
    return ["--num-machines", str(MACHINES), "--machine-rank", str(rank), "--main-process-ip", "127.0.0.1",
            "--main-process-port", str(port), "--num-processes", str(processes)]


def start_machine(tmp_path: Path, rank: int, port: int, *argv: str) -> subprocess.Popen:
    """One machine's `erniekit-lite train`, as a separate launcher (in a session of its own, as on its own host)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "erniekit_lite", "train", *argv, *machine_flags(rank, port)]
    return subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def two_machines(tmp_path: Path, *argv: str, timeout: float = 300) -> list[tuple[int, str, str]]:
    port = free_port()
    machines = [start_machine(tmp_path, rank, port, *argv) for rank in range(MACHINES)]
    ends = [m.communicate(timeout=timeout) for m in machines]
    return [(m.returncode, *end) for m, end in zip(machines, ends)]


def moe_recipe(tmp_path: Path, model_dir: Path) -> Path:
    recipe = {
        "model": {"path": str(model_dir)},
        "data": {"train": [str(write_data(tmp_path / "data.jsonl"))], "max_length": 64, "packing": True},
        "output": {"dir": str(tmp_path / "unused"), "sample_prompts": ["hello"]},
        "train": {"learning_rate": 2e-3, "max_steps": 6, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1,
                  "logging_steps": 1, "save_steps": 2, "activation_checkpointing": False, "seed": 0,
                  "lr_scheduler_type": "cosine"},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_moe_dir):
    """The uninterrupted 2-machine FSDP2 run on the tiny MoE: (recipe, fp32 FSDP2 config, run dir, both machines'
    (exit status, stdout, stderr))."""
    where = tmp_path_factory.mktemp("two-machines")
    recipe, config = moe_recipe(where, tiny_moe_dir), fp32_config(where)
    out = where / "run"
    done = two_machines(where, str(recipe), f"output.dir={out}", "--accelerate-config", str(config))
    for code, _, stderr in done:
        assert code == 0, stderr[-4000:]
    return recipe, config, out, done


@pytest.mark.slow  # two launchers and one single process: ~60 s on 2 cores
def test_two_machines_train_like_one_process_with_twice_the_accumulation(uninterrupted, tmp_path):
    """Per-step losses, token counts and the MoE's expert load of 2 machines x 1 process equal 1 process x 2
    accumulated rows; global rank 0 (machine 0) alone prints and writes the run dir's own files."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    recipe, _, two, done = uninterrupted
    one = tmp_path / "one-process"
    single = train_cli(tmp_path, str(recipe), f"output.dir={one}", "train.gradient_accumulation_steps=2")
    assert single.returncode == 0, single.stderr[-4000:]

    losses = step_losses(two)
    assert len(losses) == 6
    assert losses == pytest.approx(step_losses(one), rel=1e-6)
    results = [json.loads((out / "train_results.json").read_text()) for out in (two, one)]
    assert results[0]["train_tokens"] == results[1]["train_tokens"] > 0
    assert results[0]["packing_efficiency"] == results[1]["packing_efficiency"]
    assert results[0]["distributed"]["strategy"] == "FSDP2" and results[0]["distributed"]["world_size"] == 2
    # Expert load: each rank counts its own rows, summed over both machines before rank 0 writes it
    loads = [json.loads((out / "expert_load.json").read_text()) for out in (two, one)]
    assert loads[0]["counts"] == loads[1]["counts"] and loads[0]["routed_tokens"] > 0

    # Written once: one start and one end event (a second writer would add its own), one sample, one "done" line
    kinds = [e["event"] for e in events(two)]
    assert kinds.count("start") == 1 and kinds.count("end") == 1 and kinds.count("log") == 7  # 6 steps + the summary
    assert len((two / "samples.jsonl").read_text().splitlines()) == 1
    (code0, out0, _), (code1, out1, _) = done
    assert out0.count("done: loss") == 1 and out0.count("sample> User: hello") == 1
    assert "done: loss" not in out1 and "sample>" not in out1
    # The final model: consolidated once from the shards, a plain model in the recipe's dtype (float32)
    model = AutoModelForCausalLM.from_pretrained(two)
    reference = AutoModelForCausalLM.from_pretrained(one)
    assert {str(t.dtype) for t in load_file(two / "model.safetensors").values()} == {"torch.float32"}
    assert max((p - reference.get_parameter(n)).abs().max().item() for n, p in model.named_parameters()) <= 5e-5


@pytest.mark.slow  # two 2-machine launches: ~70 s on 2 cores
def test_sigterm_to_one_machine_stops_both_and_resume_matches(uninterrupted, tmp_path):
    """SIGTERM to machine 1's launcher (not the one with rank 0): both machines finish the same step, save one
    checkpoint, sharded (each rank's model and optimizer shard, both ranks' RNG states) and exit 143; `--resume`
    on both reads the sharded checkpoint and trains the remaining steps as the uninterrupted run did."""
    import psutil

    from erniekit_lite.train import checkpoints

    recipe, config, reference, _ = uninterrupted
    out, port = tmp_path / "stopped", free_port()
    argv = [str(recipe), f"output.dir={out}", "--accelerate-config", str(config)]
    machines = [start_machine(tmp_path, rank, port, *argv) for rank in range(MACHINES)]
    deadline = time.time() + 240
    while not any(e["event"] == "log" and e["step"] >= 3 for e in events(out)):  # past checkpoint-2
        assert time.time() < deadline and all(m.poll() is None for m in machines), "no step 3 in time"
        time.sleep(0.05)
    trees = [psutil.Process(m.pid).children(recursive=True) for m in machines]
    machines[1].send_signal(signal.SIGTERM)
    ends = [m.communicate(timeout=240) for m in machines]
    assert [m.returncode for m in machines] == [143, 143], ends[0][1][-3000:] + ends[1][1][-3000:]
    for tree in trees:
        psutil.wait_procs(tree, timeout=10)
        assert not [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    end = events(out)[-1]
    stop = end["step"]
    assert end["event"] == "end" and end["status"] == "stopped" and 3 <= stop < 6
    assert f"stopped at step {stop} of 6" in ends[0][1]  # said once, by global rank 0 on machine 0
    assert "Traceback" not in ends[0][1] + ends[1][1]
    saved = out / f"checkpoint-{stop}"
    assert checkpoints.complete(out)[-1] == saved and not list(out.glob("tmp-*"))
    names = {p.name for p in saved.iterdir()}
    assert {"rng_state_0.pth", "rng_state_1.pth", "pytorch_model_fsdp_0", "optimizer_0"} <= names
    assert not names & {"model.safetensors", "pytorch_model_fsdp.bin", "optimizer.bin"}  # nothing gathered
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (saved / part).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    # A sharded checkpoint's weights as one plain model, without training: accelerate's merge-weights
    import shutil

    from accelerate.utils import merge_fsdp_weights
    from transformers import AutoModelForCausalLM

    merged = tmp_path / "merged"
    merge_fsdp_weights(str(saved / "pytorch_model_fsdp_0"), str(merged))
    shutil.copy(reference / "config.json", merged)
    _, loading = AutoModelForCausalLM.from_pretrained(merged, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"]

    resumed = two_machines(tmp_path, *argv, "--resume")
    assert [code for code, _, _ in resumed] == [0, 0], resumed[0][2][-3000:] + resumed[1][2][-3000:]
    assert f"resuming from {saved}" in resumed[0][1]
    logged = [e["step"] for e in events(out) if e["event"] == "log" and "loss" in e]
    assert logged == list(range(1, 7))  # each step once
    ref, got = history(reference), history(out)
    assert [h["step"] for h in got] == list(range(1, 7))
    for r, g in zip(ref[stop:], got[stop:]):
        assert g["learning_rate"] == pytest.approx(r["learning_rate"], rel=1e-9), g["step"]
        assert (g["loss"], g["grad_norm"]) == pytest.approx((r["loss"], r["grad_norm"]), rel=1e-6), g["step"]


@pytest.mark.slow  # no training, but two launchers waiting out a 5 s rendezvous: ~25 s on 2 cores
def test_a_machine_that_never_joins_fails_in_one_line(tmp_path, tiny_own_dir):
    """Machine 0 alone (it hosts the rendezvous; given by flags) and machine 1 alone (nobody listens on the port;
    given by an accelerate config file's keys), each with --join-timeout 5: both fail within the timeout (plus
    start-up), in one line naming the address and port."""
    from helpers import write_recipe

    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_own_dir, out=tmp_path / "out")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HOME": str(tmp_path / "hf")}
    ports = free_port(), free_port()
    config = tmp_path / "machine-1.yaml"
    shipped = yaml.safe_load(fp32_config(tmp_path).read_text())
    config.write_text(yaml.safe_dump({**shipped, "num_machines": 2, "machine_rank": 1, "main_process_ip": "127.0.0.1",
                                      "main_process_port": ports[1], "num_processes": 2}))
    given = [machine_flags(0, ports[0]), ["--accelerate-config", str(config)]]
    started = time.time()
    alone = [subprocess.Popen([sys.executable, "-m", "erniekit_lite", "train", str(recipe), *given[rank], "--join-timeout", "5"],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(MACHINES)]
    ends = [p.communicate(timeout=120) for p in alone]
    assert time.time() - started < 60
    for rank, (p, (_, stderr)) in enumerate(zip(alone, ends)):
        assert p.returncode == 2, stderr[-3000:]
        last = stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: --main-process-ip/--main-process-port: machine rank {rank} of 2 waited 5 s at "
                               f"the rendezvous 127.0.0.1:{ports[rank]}"), last
        assert "Traceback" not in stderr and "frame #" not in stderr  # neither torch's traceback nor its C++ retry logs
    assert "1/2 clients joined" in ends[0][1].strip().splitlines()[-1]  # torch's words: the host counted who came
    assert not (tmp_path / "out").exists()  # nothing trained, nothing written


@pytest.mark.parametrize("flags, message", [
    (["--num-machines", "2", "--main-process-ip", "10.0.0.1", "--num-processes", "16"],
     "--machine-rank: expected this machine's rank, 0 to 1 (got None)"),
    (["--num-machines", "2", "--machine-rank", "2", "--main-process-ip", "10.0.0.1", "--num-processes", "16"],
     "--machine-rank: expected this machine's rank, 0 to 1 (got 2)"),
    (["--num-machines", "2", "--machine-rank", "1", "--num-processes", "16"], "--main-process-ip: expected the address of machine 0"),
    (["--num-machines", "2", "--machine-rank", "1", "--main-process-ip", "10.0.0.1", "--num-processes", "15"],
     "--num-processes: expected the total over all 2 machines, a multiple of 2"),
    (["--num-machines", "2", "--machine-rank", "1", "--main-process-ip", "10.0.0.1"],
     "--num-processes: expected the total over all 2 machines, a multiple of 2 (machines x processes per machine; got None)"),
    (["--num-machines", "2", "--machine-rank", "0", "--main-process-ip", "h", "--main-process-port", "70000", "--num-processes", "2"],
     "--main-process-port: expected a port, 1 to 65535, the same on every machine (got 70000)"),
    (["--num-machines", "0", "--num-processes", "2"], "--num-machines: expected 1 or more (got 0)"),
    (["--machine-rank", "1", "--main-process-ip", "h", "--num-processes", "2"], "--num-machines: expected the number of machines"),
    (["--num-machines", "2", "--machine-rank", "0", "--main-process-ip", "h", "--num-processes", "2", "--join-timeout", "0"],
     "--join-timeout: expected a number of seconds, 1 or more (got 0)"),
])
def test_bad_machine_flags_are_one_line(tmp_path, capsys, tiny_own_dir, flags, message):
    from erniekit_lite.cli import main
    from helpers import write_recipe

    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_own_dir)
    assert main(["train", str(recipe), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_machine_flags_reach_accelerate_launch_over_the_config_file(tmp_path, tiny_own_dir):
    """What each machine runs: accelerate launch's own flags (the flag over the config file's key), the rendezvous
    timeout in the key of the config's backend, and DeepSpeed through torch elastic rather than pdsh."""
    from accelerate.commands.launch import launch_command_parser

    from erniekit_lite.launch import Machines, launch_command
    from erniekit_lite.launcher import RENDEZVOUS
    from helpers import write_recipe

    recipe = str(write_recipe(tmp_path / "recipe.yaml", tiny_own_dir))
    config = tmp_path / "multi.yaml"
    shipped = yaml.safe_load((ROOT / "recipes" / "accelerate" / "fsdp2.yaml").read_text())
    config.write_text(yaml.safe_dump({**shipped, "num_machines": 2, "machine_rank": 1, "main_process_ip": "10.1.2.3",
                                      "main_process_port": 6000, "num_processes": 16, "rdzv_backend": "c10d"}))

    def parsed(machines, config_file=str(config), num_processes=None):
        command, env = launch_command(recipe, [], num_processes, config_file, machines)
        assert command[1:3] == ["-m", "erniekit_lite.launcher"]
        return vars(launch_command_parser().parse_args(command[3:])), env

    # all from the config file: only the timeout is added (c10d reads join_timeout)
    args, env = parsed(Machines())
    assert (args["num_machines"], args["machine_rank"], args["main_process_ip"], args["main_process_port"]) == (2, 1, "10.1.2.3", 6000)
    assert args["rdzv_conf"] == "join_timeout=120" and env[RENDEZVOUS] == "10.1.2.3:6000 1 2 120"
    # flags win over the config file's keys
    args, env = parsed(Machines(2, 0, "10.9.9.9", 7000, 30), num_processes=32)
    assert (args["num_processes"], args["machine_rank"], args["main_process_ip"], args["main_process_port"]) == (32, 0, "10.9.9.9", 7000)
    assert args["rdzv_conf"] == "join_timeout=30" and env[RENDEZVOUS] == "10.9.9.9:7000 0 2 30"
    # no config file: DDP over torch elastic's static rendezvous (its `timeout`), the default port
    args, env = parsed(Machines(2, 1, "10.9.9.9"), config_file=None, num_processes=4)
    assert args["multi_gpu"] and args["main_process_port"] == 29500 and args["rdzv_conf"] == "timeout=120"
    assert args["training_script"] == "erniekit_lite" and args["module"] and args["training_script_args"][:2] == ["train", recipe]
    # DeepSpeed across machines: accelerate's standard (torch elastic) launcher, not pdsh over ssh
    zero3 = fp32_config(tmp_path, "deepspeed-zero3.yaml")
    args, _ = parsed(Machines(2, 0, "10.9.9.9"), config_file=str(zero3), num_processes=4)
    assert args["deepspeed_multinode_launcher"] == "standard" and args["rdzv_conf"] == "timeout=120"
    # one machine: no rendezvous variable, a free port as before; accelerate's defaults said outright (no advice printed)
    args, env = parsed(Machines(), config_file=None, num_processes=2)
    assert args["num_machines"] == 1 and RENDEZVOUS not in env
    assert (args["mixed_precision"], args["dynamo_backend"]) == ("no", "no")


@pytest.mark.slow  # two torchrun launchers: ~35 s on 2 cores
def test_torchrun_on_two_machines_trains_the_same(uninterrupted, tmp_path):
    """`torchrun ... -m erniekit_lite train RECIPE` (no accelerate launch, c10d rendezvous, plain DDP: an accelerate
    config is not read by torchrun) on two loopback machines trains the same steps as the accelerate-launched run."""
    recipe, _, reference, _ = uninterrupted
    out, port = tmp_path / "torchrun", free_port()
    # ACCELERATE_USE_CPU: what `train --num-processes` sets without a GPU; with GPUs nothing is needed
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1",
           "ACCELERATE_USE_CPU": "true"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "test"]
    machines = [subprocess.Popen([*torchrun, "-m", "erniekit_lite", "train", str(recipe), f"output.dir={out}"], env=env, cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(MACHINES)]
    ends = [m.communicate(timeout=300) for m in machines]
    assert [m.returncode for m in machines] == [0, 0], ends[0][1][-3000:] + ends[1][1][-3000:]
    said = "".join(stdout for stdout, _ in ends)
    assert said.count("distributed: DDP over 2 processes (gloo)") == 1 and said.count("done: loss") == 1
    assert step_losses(out) == pytest.approx(step_losses(reference), rel=1e-6)
    assert json.loads((out / "train_results.json").read_text())["train_tokens"] == json.loads((reference / "train_results.json").read_text())["train_tokens"]


@pytest.mark.slow  # two machines x 2 processes: ~40 s on 2 cores
def test_a_stop_from_the_other_machine_ends_every_local_process_cleanly(tmp_path, tiny_own_dir):
    """Two processes per machine (DDP): after a stop that came from machine 1, machine 0's launcher sees its first
    worker exit 143 and SIGTERMs the other, global rank 0 included (torch elastic's reaction to a failure). They
    ignore it once saved, so both machines exit 143 with no traceback, and rank 0 has said and recorded the stop."""
    from erniekit_lite.train import checkpoints
    from helpers import write_recipe

    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_own_dir, data={"train": [str(write_data(tmp_path / "data.jsonl"))], "max_length": 64},
                          out=tmp_path / "run", train={"max_steps": 200, "save_steps": 1000, "logging_steps": 1, "per_device_train_batch_size": 1,
                                                       "activation_checkpointing": False, "num_train_epochs": 100})
    out, port = tmp_path / "run", free_port()
    # Global rank 0 lingers 3 s at exit, so its local partner (rank 1) always exits first, as it may on a loaded node
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("import atexit, os, time\nif os.environ.get('RANK') == '0':\n    atexit.register(time.sleep, 3)\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)}
    machines = [subprocess.Popen([sys.executable, "-m", "erniekit_lite", "train", str(recipe), *machine_flags(rank, port, processes=4)],
                                 env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
                for rank in range(MACHINES)]
    deadline = time.time() + 240
    while not any(e["event"] == "log" and e["step"] >= 2 for e in events(out)):
        assert time.time() < deadline and all(m.poll() is None for m in machines), "no step 2 in time"
        time.sleep(0.05)
    machines[1].send_signal(signal.SIGTERM)
    ends = [m.communicate(timeout=240) for m in machines]
    assert [m.returncode for m in machines] == [143, 143], ends[0][1][-3000:]
    assert "Traceback" not in ends[0][1] + ends[1][1]
    end = events(out)[-1]
    assert end["event"] == "end" and end["status"] == "stopped"
    assert f"stopped at step {end['step']} of 200" in ends[0][1]
    assert checkpoints.complete(out)[-1] == out / f"checkpoint-{end['step']}"
    assert {f"rng_state_{r}.pth" for r in range(4)} <= {p.name for p in (out / f"checkpoint-{end['step']}").iterdir()}
