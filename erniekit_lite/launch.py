"""`erniekit-lite train ... --num-processes N`: the same command, run once per device under `accelerate launch`.

Each launched process runs `python -m erniekit_lite train RECIPE OVERRIDES`, the single-process code path;
transformers' Trainer picks the process group, and the FSDP / DeepSpeed settings of an accelerate config file,
up from the environment `accelerate launch` sets.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import yaml

from erniekit_lite.errors import UserError

STOP_TIMEOUT = 300  # seconds a stopped worker has to finish its step and save (a second Ctrl-C ends it at once)


def launch(recipe: str, overrides: list[str], num_processes: int | None, config_file: str | None) -> int:
    """Run the training command under `accelerate launch`; returns its exit status (128 + signal after a stop)."""
    command, env = launch_command(recipe, overrides, num_processes, config_file)
    return run_forwarding_signals(command, env)


def run_forwarding_signals(command: list[str], env: dict) -> int:
    """Run the launcher; a SIGTERM, Ctrl-C or hangup of this process stops the workers as it stops a single process.

    The launcher (torch elastic, under `accelerate launch`) passes one signal on to each worker, which finishes its
    step, saves a checkpoint and exits; the workers run in sessions of their own, so nothing else reaches them. The
    launcher gets a session of its own too: a terminal's Ctrl-C reaches only this process, which passes it on once
    (two would make the workers stop at once, without a checkpoint). A second signal kills the launcher and workers
    at once, as a second Ctrl-C does to a single process. Without this, `kill` of this process left the launcher and
    workers training, and Ctrl-C had subprocess.call SIGKILL the launcher while the workers were saving.
    """
    received: list[int] = []
    process: subprocess.Popen | None = None

    def forward(signum, frame):
        received.append(signum)
        if process is None:
            return  # not started yet: passed on as soon as it is
        if len(received) == 1:
            process.send_signal(_stop_signal(signum))
        else:
            _kill_tree(process.pid)

    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    main_thread = threading.current_thread() is threading.main_thread()  # handlers can only be set there
    previous = {s: signal.signal(s, forward) for s in handled} if main_thread else {}
    try:
        process = subprocess.Popen(command, env=env, start_new_session=True)
        if received:
            process.send_signal(_stop_signal(received[0]))
        code = process.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    # Stopped workers exit 128 + signal, the launcher 1 (it re-raises the signal as an exception); say what happened
    return 128 + received[0] if received and code != 0 else code


def _stop_signal(signum: int) -> int:
    # The launcher would pass a hangup on, and it kills the workers without a checkpoint; they get a stop request
    return signal.SIGTERM if signum == signal.SIGHUP else signum


def _kill_tree(pid: int) -> None:
    import psutil  # an accelerate dependency

    try:
        parent = psutil.Process(pid)
        tree = [*parent.children(recursive=True), parent]  # the workers are the launcher's children
    except psutil.NoSuchProcess:
        return
    for process in tree:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def launch_command(recipe: str, overrides: list[str], num_processes: int | None, config_file: str | None) -> tuple[list[str], dict]:
    import torch  # already loaded: checking the recipe imported TRL

    if num_processes is not None and num_processes < 1:
        raise UserError(f"--num-processes: expected 1 or more (got {num_processes})")
    config = _read_config(config_file) if config_file is not None else {}
    _check_deepspeed_precision(config, config_file, recipe, overrides, torch.cuda.is_available())
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if num_processes is not None:
        command += ["--num_processes", str(num_processes)]  # overrides the config file's
    if config_file is not None:
        command += ["--config_file", config_file]
    elif num_processes is not None and num_processes > 1:
        command += ["--multi_gpu"]  # plain data parallelism (DDP): one process per device
    if "main_process_port" not in config:  # a multi-node config names its own; else avoid a busy 29500
        command += ["--main_process_port", str(_free_port())]
    command += ["-m", "erniekit_lite", "train", recipe, *overrides]

    env = dict(os.environ)
    # After passing a stop signal on, the launcher SIGKILLs workers that have not exited within this many seconds
    # (torch's default, 30, is short for finishing a large model's step and saving its checkpoint)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(STOP_TIMEOUT))
    if not torch.cuda.is_available():
        # The processes train on CPU over gloo. Not accelerate's `--cpu`: with it, `accelerate launch` starts a
        # single process (its multi-CPU mode needs mpirun); this variable makes each Trainer use the CPU instead.
        env["ACCELERATE_USE_CPU"] = "true"
        env["ERNIEKIT_SHARDING_ON_CPU"] = "1"  # accelerate alone would run an FSDP config as plain DDP here (train/distribution.py)
    return command, env


def print_on_main(*args, **kwargs) -> None:
    """`print` for run messages: every launched process runs the same code, and only global rank 0 speaks."""
    if os.environ.get("RANK", "0") == "0":
        print(*args, **kwargs)


def end_process_group() -> None:
    """A launched worker that finished: every rank waits for the others, then the process group is torn down.

    Left to interpreter exit, gloo's threads are sometimes still joinable when their objects are destroyed, and the
    worker aborts with "terminate called without an active exception" (seen on a loaded 2-core machine, after a
    run that had saved everything), which fails the launch."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _read_config(path: str) -> dict:
    if not Path(path).is_file():
        raise UserError(f"--accelerate-config: {path}: file not found")
    try:
        config = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise UserError(f"--accelerate-config: {path}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(config, dict):
        raise UserError(f"--accelerate-config: {path}: expected an accelerate config (a YAML mapping)")
    return config


def _check_deepspeed_precision(config: dict, path: str | None, recipe: str, overrides: list[str], cuda: bool) -> None:
    """accelerate turns a DeepSpeed config's `mixed_precision` into DeepSpeed's bf16/fp16 switches, and transformers
    then refuses to train when they differ from the recipe's `train.bf16` / `train.fp16` (a traceback from every
    process). Said here once, before any process starts."""
    from erniekit_lite import recipe as recipes

    if config.get("distributed_type") != "DEEPSPEED" or (config.get("deepspeed_config") or {}).get("deepspeed_config_file"):
        return  # a DeepSpeed JSON of its own may say "auto"
    mixed = config.get("mixed_precision") or "no"  # YAML 1.1 reads a bare `no` as false
    train = recipes.load(recipe, overrides).train
    bf16 = train.get("bf16", cuda and _bf16_supported())  # training_args' default
    wanted = "bf16" if bf16 else "fp16" if train.get("fp16") else "no"
    if str(mixed) != wanted:
        keys = {"bf16": "train.bf16: true", "fp16": "train.fp16: true", "no": "neither train.bf16 nor train.fp16"}
        raise UserError(f"--accelerate-config: {path}: mixed_precision: {mixed} needs {keys.get(str(mixed), str(mixed))} "
                        f"in the recipe, which has {keys[wanted]} (DeepSpeed takes its precision from both); "
                        f"set mixed_precision: {wanted!r} there or change the recipe")


def _bf16_supported() -> bool:
    import torch

    return torch.cuda.is_bf16_supported()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
