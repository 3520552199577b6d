"""recipes/slurm/sft-full-2x8.sbatch: valid shell, and the commands it runs on each node, with SLURM faked.

`srun`, `scontrol` and `erniekit-lite` are stand-ins on PATH: srun runs its command once per node of the job with
the variables SLURM sets in each task, and erniekit-lite records what it was given. What it was given is then
parsed by the real CLI and turned into the `accelerate launch` arguments each node's launcher gets."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import needs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "recipes" / "slurm" / "sft-full-2x8.sbatch"
NODES = ["gpu-node07", "gpu-node08"]

# srun: one task per node (what --ntasks-per-node=1 gives), each with the node's SLURM_NODEID and SLURM_PROCID
SRUN = r"""#!/usr/bin/env python3
import json, os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"srun": args}) + "\n")
while args[0].startswith("-"):
    args.pop(0)
for node in range(int(os.environ["SLURM_NNODES"])):
    env = {**os.environ, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node)}
    subprocess.run(args, env=env, check=True)
"""
SCONTROL = r"""#!/usr/bin/env python3
import os, sys
assert sys.argv[1:] == ["show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], sys.argv
print("gpu-node07\ngpu-node08")
"""
ERNIEKIT = r"""#!/usr/bin/env python3
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"erniekit-lite": sys.argv[1:], "cwd": os.getcwd()}) + "\n")
"""


def test_the_script_is_valid_bash():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_sbatch_header_asks_for_two_nodes_of_eight_gpus_one_launcher_each():
    header = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", SCRIPT.read_text(), re.M))
    assert header["nodes"] == "2" and header["ntasks-per-node"] == "1" and header["gpus-per-node"] == "8"
    assert header["signal"] == "TERM@600"  # a stop with a checkpoint before the time limit


def run_faked(tmp_path: Path, *overrides: str) -> list[dict]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("erniekit-lite", ERNIEKIT)):
        (bin_dir / name).write_text(text.replace("/usr/bin/env python3", sys.executable, 1))
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log.jsonl"
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log), "HOME": str(tmp_path),
           "SLURM_JOB_NODELIST": "gpu-node[07-08]", "SLURM_NNODES": "2", "SLURM_SUBMIT_DIR": str(ROOT),
           "SLURM_JOB_ID": "4242"}
    done = subprocess.run(["bash", str(SCRIPT), *overrides], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_each_node_runs_one_launcher_with_its_rank_and_the_first_nodes_address(tmp_path, monkeypatch):
    from erniekit_lite import launch as launching
    from erniekit_lite.cli import main

    calls = run_faked(tmp_path, "data.train.0.path=/shared/data/my data.jsonl")
    srun, *nodes = calls
    assert srun["srun"][:3] == ["--ntasks-per-node=1", "--kill-on-bad-exit=0", "--wait=300"]
    recipe = "recipes/ernie-4.5-21b-a3b/sft-full.yaml"
    assert [node["erniekit-lite"] for node in nodes] == [
        ["train", recipe, "train.gradient_accumulation_steps=2", "data.train.0.path=/shared/data/my data.jsonl", "--resume",
         "--num-machines", "2", "--machine-rank", str(rank), "--main-process-ip", NODES[0], "--main-process-port", "29500",
         "--join-timeout", "600", "--num-processes", "16", "--accelerate-config", "recipes/accelerate/fsdp2.yaml"]
        for rank in range(2)]
    assert {node["cwd"] for node in nodes} == {str(ROOT)}  # relative recipe and config paths resolve in the checkout

    # What the real CLI makes of each node's command: accelerate launch's multi-machine arguments
    from accelerate.commands.launch import launch_command_parser

    monkeypatch.chdir(ROOT)
    launched = []
    monkeypatch.setattr(launching, "launch", lambda *a: launched.append(launching.launch_command(*a)) or 0)
    monkeypatch.setattr(launching, "_check_deepspeed_precision", lambda *a: None)  # FSDP: nothing to check
    for rank, node in enumerate(nodes):
        assert main(node["erniekit-lite"]) == 0
        command, env = launched[rank]
        args = vars(launch_command_parser().parse_args(command[3:]))
        assert (args["num_machines"], args["machine_rank"], args["main_process_ip"], args["main_process_port"]) == (2, rank, NODES[0], 29500)
        assert args["num_processes"] == 16 and args["config_file"] == "recipes/accelerate/fsdp2.yaml"
        assert args["rdzv_conf"] == "timeout=600" and env["ERNIEKIT_RENDEZVOUS"] == f"{NODES[0]}:29500 {rank} 2 600"
        assert args["training_script_args"][:2] == ["train", "recipes/ernie-4.5-21b-a3b/sft-full.yaml"]
        assert "train.resume_from_checkpoint=auto" in args["training_script_args"]
        assert "data.train.0.path=/shared/data/my data.jsonl" in args["training_script_args"]  # a space stays inside


@needs(shutil.which("shellcheck"), "shellcheck", "apt-get install shellcheck")
def test_shellcheck_finds_nothing():
    done = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
