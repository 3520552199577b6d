"""`erniekit-lite train ... --num-processes N`: the same command, run once per device under `accelerate launch`.

Each launched process runs `python -m erniekit_lite train RECIPE OVERRIDES`, the single-process code path;
transformers' Trainer picks the process group, and the FSDP / DeepSpeed settings of an accelerate config file,
up from the environment `accelerate launch` sets.

Several machines (`--num-machines N --machine-rank R --main-process-ip HOST --main-process-port P`, or the same keys
in the accelerate config file): the command runs once per machine, each launcher starting its share of the
`--num-processes` total; torch elastic's static rendezvous at HOST:P (machine 0 hosts it) joins them, and waits
`--join-timeout` seconds for the others before `launcher.py` says which address and port it waited on.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import yaml

from erniekit_lite.errors import UserError

STOP_TIMEOUT = 300  # seconds a stopped worker has to finish its step and save (a second Ctrl-C ends it at once)
JOIN_TIMEOUT = 120  # seconds a machine waits at the rendezvous for the others
DEFAULT_PORT = 29500  # accelerate's and torchrun's: every machine must name the same one


@dataclass(frozen=True)
class Machines:
    """The multi-machine flags as given (None: not given; the accelerate config file's keys then apply)."""

    num_machines: int | None = None
    machine_rank: int | None = None
    main_process_ip: str | None = None
    main_process_port: int | None = None
    join_timeout: int | None = None

    def given(self) -> bool:
        return any(v is not None for v in (self.num_machines, self.machine_rank, self.main_process_ip, self.main_process_port))


def launch(recipe: str, overrides: list[str], num_processes: int | None, config_file: str | None,
           machines: Machines = Machines(), offload_parameters: bool = False) -> int:
    """Run the training command under `accelerate launch`; returns its exit status (128 + signal after a stop)."""
    command, env = launch_command(recipe, overrides, num_processes, config_file, machines, offload_parameters)
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


# train.offload: parameters without an accelerate config: FSDP2 as recipes/accelerate/fsdp2.yaml has it (one unit per
# decoder layer, sharded checkpoints), the mixed precision left to the recipe's train.bf16
FSDP2_FLAGS = ["--use_fsdp", "--fsdp_version", "2", "--fsdp_reshard_after_forward", "true", "--fsdp_auto_wrap_policy",
               "TRANSFORMER_BASED_WRAP", "--fsdp_state_dict_type", "SHARDED_STATE_DICT"]


def launch_command(recipe: str, overrides: list[str], num_processes: int | None, config_file: str | None,
                   machines: Machines = Machines(), offload_parameters: bool = False) -> tuple[list[str], dict]:
    import torch  # ~2 s: whether the processes train on CUDA sets their environment

    if num_processes is not None and num_processes < 1:
        raise UserError(f"--num-processes: expected 1 or more (got {num_processes})")
    config = _read_config(config_file) if config_file is not None else {}
    _check_deepspeed_precision(config, config_file, recipe, overrides, torch.cuda.is_available())
    if offload_parameters and config.get("distributed_type") == "DEEPSPEED":
        raise UserError(f"train.offload: parameters runs under FSDP2, and {config_file} is a DeepSpeed config: set "
                        "offload_param_device and offload_optimizer_device there and leave train.offload at none")
    # accelerate's launcher, run by launcher.py, which says a rendezvous timeout or a stop in one line
    command = [sys.executable, "-m", "erniekit_lite.launcher"]
    if offload_parameters and num_processes is None and config_file is None:
        num_processes = 1  # one GPU, its model's state on the host
    if num_processes is not None:
        command += ["--num_processes", str(num_processes)]  # overrides the config file's
    if config_file is not None:
        command += ["--config_file", config_file]
    elif offload_parameters:
        command += FSDP2_FLAGS
    elif (num_processes or 1) > 1:
        command += ["--multi_gpu"]  # plain data parallelism (DDP): one process per device
    if config_file is None:  # accelerate's defaults, said outright: else it prints 5 lines advising `accelerate config`
        command += ["--mixed_precision", "no", "--dynamo_backend", "no"]  # the Trainer sets the run's own precision
    if offload_parameters:  # beats the config file's key; also gives the process group its CPU backend on CUDA
        command += ["--fsdp_offload_params", "true"]
    several = _several_machines(machines, config, num_processes)
    if several is not None:
        command += several.arguments
    elif config_file is None:
        command += ["--num_machines", "1"]
    elif "main_process_port" not in config:  # a config that names its own keeps it; else avoid a busy 29500
        command += ["--main_process_port", str(_free_port())]
    command += ["-m", "erniekit_lite", "train", recipe, *overrides]

    env = dict(os.environ)
    if several is not None and several.described is not None:
        from erniekit_lite.launcher import RENDEZVOUS

        env[RENDEZVOUS] = several.described
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


# Modules whose functions take `group=<the default group>` as a default argument, evaluated at import: imported
# while a process group exists, they hold it for good (torch.distributed.nn.functional: 10 references, imported by
# torch._dynamo, which DDP's constructor imports; DeepSpeed's comm backend: 2, imported by accelerate when installed)
HOLD_THE_GROUP = ("torch.distributed.nn.functional", "deepspeed.comm.torch")


def begin_process_group() -> None:
    """A launched worker, before its process group forms: the modules of `HOLD_THE_GROUP` imported first, so their
    defaults are None. Otherwise `destroy_process_group` cannot free the group, gloo's threads (pt_gloo_runloop,
    gloo_tcp_loop) outlive it into interpreter exit, and a worker sometimes aborts there with "terminate called
    without an active exception" after a run that saved everything (seen on a 2-core AMD EPYC), failing the launch."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import importlib

        for name in HOLD_THE_GROUP:
            try:
                importlib.import_module(name)
            except ImportError:  # DeepSpeed is optional
                pass


def end_process_group(wait: bool = True) -> None:
    """A launched worker that is done: the process group torn down and its threads joined (see `begin_process_group`)
    before the interpreter exits. `wait`: every rank meets first (a finished run); a stopped run's ranks are each past
    the stop checkpoint's last barrier, and one whose stop came late (after the final save) meets no one, so each
    frees its own at once."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()  # the finished trainer's reference cycles, its DDP wrapper among them, which holds the group
        if wait:
            dist.barrier()
        dist.destroy_process_group()
        # FSDP2's sharded parameters keep their DeviceMesh alive (torch's DTensor metadata caches hold their specs), and
        # the mesh holds the group in `_pg_registry`: emptied, the group and its gloo threads go now, not at exit
        for mesh in [o for o in gc.get_objects() if type(o).__name__ == "DeviceMesh"]:
            getattr(mesh, "_pg_registry", {}).clear()
        gc.collect()


@dataclass(frozen=True)
class _Rendezvous:
    arguments: list[str]  # for `accelerate launch`
    described: str | None  # for launcher.py's message: "HOST:PORT MACHINE_RANK NUM_MACHINES TIMEOUT"; None: one machine


def _several_machines(machines: Machines, config: dict, num_processes: int | None) -> _Rendezvous | None:
    """The `accelerate launch` arguments of a multi-machine run, each value the flag's or else the config file's;
    None for one machine. Checked here, as one line naming the flag, instead of an assertion (or a wait) later."""
    if machines.join_timeout is not None and machines.join_timeout < 1:
        raise UserError(f"--join-timeout: expected a number of seconds, 1 or more (got {machines.join_timeout})")
    pick = lambda flag, key: flag if flag is not None else config.get(key)
    count = pick(machines.num_machines, "num_machines")
    if count is not None and (not isinstance(count, int) or count < 1):
        raise UserError(f"--num-machines: expected 1 or more (got {count})")
    if count is None or count == 1:
        if count is None and (machines.machine_rank is not None or machines.main_process_ip is not None):
            raise UserError("--num-machines: expected the number of machines, given with --machine-rank and "
                            "--main-process-ip")
        if machines.main_process_port is None:
            return None
        return _Rendezvous(["--main_process_port", str(_port(machines.main_process_port))], None)  # one machine
    rank, host = pick(machines.machine_rank, "machine_rank"), pick(machines.main_process_ip, "main_process_ip")
    port, total = pick(machines.main_process_port, "main_process_port"), pick(num_processes, "num_processes")
    if rank is None or not isinstance(rank, int) or not 0 <= rank < count:
        raise UserError(f"--machine-rank: expected this machine's rank, 0 to {count - 1} (got {rank}); machine 0 hosts "
                        "the rendezvous")
    if not host:
        raise UserError("--main-process-ip: expected the address of machine 0, which every machine can reach (the "
                        "same on every machine)")
    port = _port(DEFAULT_PORT if port is None else port)
    if total is None or not isinstance(total, int) or total < count or total % count:
        raise UserError(f"--num-processes: expected the total over all {count} machines, a multiple of {count} "
                        f"(machines x processes per machine; got {total})")
    timeout = machines.join_timeout or JOIN_TIMEOUT
    # static rendezvous (accelerate's default) reads `timeout`, c10d (elastic restarts) `join_timeout`
    key = "timeout" if config.get("rdzv_backend", "static") == "static" else "join_timeout"
    arguments = ["--num_machines", str(count), "--machine_rank", str(rank), "--main_process_ip", str(host),
                 "--main_process_port", str(port), "--rdzv_conf", f"{key}={timeout}"]
    if config.get("distributed_type") == "DEEPSPEED":
        arguments += ["--deepspeed_multinode_launcher", "standard"]  # torch elastic, as here; accelerate's default is pdsh over ssh
    return _Rendezvous(arguments, f"{host}:{port} {rank} {count} {timeout}")


def _port(port) -> int:
    if not isinstance(port, int) or not 0 < port < 65536:
        raise UserError(f"--main-process-port: expected a port, 1 to 65535, the same on every machine (got {port})")
    return port


def launch_of(num_processes: int | None, config_file: str | None, offload_parameters: bool = False):
    """The launch `train` makes of these options (`run_plan.Launch`): FSDP or DeepSpeed as the accelerate config says
    (FSDP2 for train.offload: parameters without one), the processes, whether ZeRO-3 shards the parameters."""
    from erniekit_lite.run_plan import Launch, zero_stage_3

    config = _read_config(config_file) if config_file is not None else {}
    kind = config.get("distributed_type")
    how = "fsdp" if kind == "FSDP" or (offload_parameters and config_file is None) else "deepspeed" if kind == "DEEPSPEED" else "plain"
    deepspeed = config.get("deepspeed_config") or {}
    zero3 = how == "deepspeed" and zero_stage_3(deepspeed.get("zero_stage"), deepspeed.get("deepspeed_config_file"))
    return Launch(how, num_processes or int(config.get("num_processes") or 1), zero3)


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
