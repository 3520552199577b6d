"""The launcher process of a launched run: `accelerate launch` as it is, with its two expected endings said plainly.

`launch.py` runs `python -m erniekit_lite.launcher ACCELERATE-LAUNCH-ARGS` instead of `accelerate launch` itself;
this module only catches what torch elastic (under accelerate) raises in two cases that are not bugs:

- a machine of a multi-machine run that waits at the rendezvous past its timeout: torch's `DistStoreError` ("1/2
  clients joined", on the machine that hosts the rendezvous) or `DistNetworkError` (the client that cannot reach
  it), each a traceback with C++ frames. Said as one line naming the address, the port and the timeout, exit 2.
- a stop: the launcher that got SIGTERM/SIGINT raises `SignalException` after its workers saved and exited, and a
  machine whose workers stopped because another machine was signalled (they stop together, `StopOnSignal`) sees
  every worker exit 128 + signal, which torch reports as `ChildFailedError`. Both exit 128 + signal, quietly: the
  workers have said what happened (global rank 0 prints where the checkpoint is).
- a worker that found a mistake in the recipe or data: it printed its one `error:` line and exited 2 (the others
  were ended by torch). Exit 2, without torch's traceback around it.

Anything else keeps torch's traceback. On a stop, torch elastic's own warnings that it received the signal and passes
it to each worker are left out (`quiet_stop_warnings`): the workers' line says what happened.
"""

from __future__ import annotations

import os
import signal
import sys

RENDEZVOUS = "ERNIEKIT_RENDEZVOUS"  # "HOST:PORT MACHINE_RANK NUM_MACHINES TIMEOUT", set by launch.py for several machines
STOP_CODES = {128 + signal.SIGTERM, 128 + signal.SIGINT}
USER_ERROR = 2  # the CLI's exit status after an `error:` line (cli.py)


def main(argv: list[str]) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(argv)
    quiet_stop_warnings()
    try:
        launch_command(args)
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        codes = {failure.exitcode for failure in e.failures.values()}
        if len(codes) == 1 and codes <= STOP_CODES:
            return codes.pop()  # stopped together with the other machines, after the same step's checkpoint
        if e.get_first_failure()[1].exitcode == USER_ERROR:
            return USER_ERROR  # a worker said what was wrong in its one `error:` line (bad data, a missing file)
        raise
    except DistError as e:
        if not os.environ.get(RENDEZVOUS):
            raise
        print(f"error: {rendezvous_timeout(os.environ[RENDEZVOUS], e)}", file=sys.stderr)
        return 2
    return 0


def rendezvous_timeout(described: str, error: Exception) -> str:
    """The one line for a rendezvous that timed out; `described` is what launch.py put in ERNIEKIT_RENDEZVOUS."""
    endpoint, rank, machines, timeout = described.split()
    host = "this machine hosts it" if rank == "0" else "machine rank 0 hosts it"
    # torch's own words say which side gave up: the host counting who joined, or a client that never got through
    said = (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(".")
    return (f"--main-process-ip/--main-process-port: machine rank {rank} of {machines} waited {timeout} s at the "
            f"rendezvous {endpoint} ({host}) and not every machine joined ({said}); start all {machines} with the "
            f"same --main-process-ip and --main-process-port, check the port is reachable from every machine, or "
            f"allow longer with --join-timeout")


# torch 2.13's warnings on a stop (torch/distributed/elastic/agent/server/api.py, multiprocessing/api.py), as written
STOP_WARNINGS = ("Received %s death signal, shutting down workers", "Sending process %s closing signal %s")


def quiet_stop_warnings() -> None:
    """Torch elastic's warning lines on a stop dropped in this launcher process; its other messages stay."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return record.msg not in STOP_WARNINGS

    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(keep)


def _quiet_store_retries() -> None:
    """torch's C++ log (read once, when torch loads) prints each rendezvous connection retry of this process with its
    C++ stack, dozens of lines before the error is even raised. Silenced in this launcher process only: the
    variable is put back before the workers are started, which inherit the environment."""
    previous = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    import torch  # noqa: F401

    if previous is None:
        del os.environ["TORCH_CPP_LOG_LEVEL"]
    else:
        os.environ["TORCH_CPP_LOG_LEVEL"] = previous


if __name__ == "__main__":
    if os.environ.get(RENDEZVOUS):
        _quiet_store_retries()
    sys.exit(main(sys.argv[1:]))
