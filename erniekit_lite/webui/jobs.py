"""One training job at a time: `erniekit-lite train` in a subprocess, owned by the server, not by a browser tab.

Because the job lives here, any page (a reload, a second browser) shows the same running job. The edited recipe
is written into the UI's state dir (`.erniekit-webui/jobs/<time>-<name>/`, with the job's `train.log`), never
over the user's recipe file. Stop sends one SIGTERM, however often it is pressed: training finishes the current
step, saves a checkpoint, writes the `end` event and exits (see erniekit_lite/train/callbacks.py); before training
has begun the CLI has no handler yet and SIGTERM ends it at once, with nothing saved.

One job per server; one run per output folder, whoever started it: the server takes the run's own lock
(train/run_lock.py: `.NAME.lock` beside the output folder) when it starts a job and hands it to the training process,
which holds it for as long as it runs. Another server's job, or a `train` from a terminal, into the same folder is
refused then, naming the holder's pid, and the job is refused while another run holds its folder.
The job runs in a process group of its own: when its process has ended, whatever it left running there is ended
too, and a server that exits stops it first (the terminal's Ctrl-C no longer reaches it directly).
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from erniekit_lite.errors import UserError
from erniekit_lite.train import checkpoints, run_lock
from erniekit_lite.webui import progress
from erniekit_lite.webui.paths import STATE_DIR

TRAIN = (sys.executable, "-m", "erniekit_lite", "train")
TAIL_BYTES = 32_768
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # tqdm moves the cursor between its bars


@dataclass
class Job:
    root: Path  # the training process's working directory
    recipe_file: Path  # relative to the root, as the CLI sees it
    output_dir: str  # as the recipe says
    log_file: Path
    process: subprocess.Popen
    started: float
    method: str = "sft"  # the recipe's: which headline metrics the page plots
    stop_requested: bool = False

    def running(self) -> bool:
        return self.process.poll() is None

    def progress(self) -> progress.Progress:
        return progress.read(self.root / self.output_dir, self.started)

    def log_tail(self, lines: int = 15) -> str:
        """The end of the log as a terminal shows it: a progress bar's carriage returns keep only its last state."""
        with open(self.log_file, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            text = f.read().decode("utf-8", errors="replace")
        shown = [ANSI.sub("", line.rstrip("\r").rsplit("\r", 1)[-1]).rstrip() for line in text.split("\n")]
        return "\n".join([line for line in shown if line][-lines:])

    def outcome(self) -> str:
        """One line: what the job is doing, or how it ended."""
        p = self.progress()
        if self.running():
            if self.stop_requested and not p.started:
                return "stopping: training had not begun, so nothing is saved"
            if self.stop_requested:
                return "stopping: the current step finishes, then a checkpoint is saved"
            return f"training ({self.recipe_file})" if p.started else f"preparing data and model ({self.recipe_file})"
        code = self.process.returncode
        if p.end is not None and p.end["status"] == "stopped":
            return (f"stopped at step {p.end['step']} of {p.end['max_steps']}: checkpoint saved in {p.end['checkpoint']} "
                    "(to go on, set train.resume_from_checkpoint: auto in the recipe and start again)")
        if code == 0:
            return f"finished: {p.step} steps; the model is in {self.output_dir}"
        if self.stop_requested and not p.started:
            return "stopped before training began: nothing saved yet"
        if self.stop_requested:  # e.g. during the final save, after the training loop ended (no handler then)
            saved = self.saved_checkpoint()
            return f"stopped after step {p.step} (exit status {code}): " + (
                f"checkpoint saved in {saved.relative_to(self.root)}" if saved else "nothing saved yet")
        return f"failed (exit status {code}): {self._error_line()}"

    def saved_checkpoint(self) -> Path | None:
        """The newest complete checkpoint this job wrote (never one an earlier run left in the same dir)."""
        found = checkpoints.complete(self.root / self.output_dir)
        mine = [c for c in found if (c / checkpoints.STATE).stat().st_mtime >= self.started]
        return mine[-1] if mine else None

    def _error_line(self) -> str:
        lines = self.log_tail(200).splitlines()
        # The CLI's one-line errors start with "error:"; anything else (a traceback) ends with the exception
        return next((line for line in reversed(lines) if line.startswith("error:")), lines[-1] if lines else "no output")


class Runner:
    def __init__(self, root: Path, command: tuple[str, ...] = TRAIN, env=lambda: dict(os.environ)):
        self.root = root
        self.command = command  # the CLI; tests put a stand-in here
        self.env = env  # the job's environment (gate.Gate.environment: a UI others reach lends no Hub login)
        self.job: Job | None = None  # the running job, or the last one (its final state stays visible)
        self._lock = threading.Lock()  # two tabs may press Start at once
        self._stops_at_exit = False

    def start(self, recipe_text: str, name: str, output_dir: str, method: str = "sft") -> Job:
        with self._lock:
            if self.job is not None and self.job.running():
                if self.job.stop_requested:
                    raise UserError(f"the last job ({self.job.recipe_file}) is still stopping; start again when it has ended")
                raise UserError(f"a job is already running ({self.job.recipe_file}); stop it or wait until it ends")
            jobs = self.root / STATE_DIR / "jobs"
            jobs.mkdir(parents=True, exist_ok=True)
            lock = self._claim(output_dir)
            try:
                job_dir = Path(tempfile.mkdtemp(prefix=f"{time.strftime('%Y%m%d-%H%M%S')}-{Path(name).stem}-", dir=jobs))
                recipe_file = (job_dir / Path(name).name).relative_to(self.root)
                (self.root / recipe_file).write_text(recipe_text, encoding="utf-8")
                log_file = job_dir / "train.log"
                started = time.time()
                with open(log_file, "wb") as log:
                    process = subprocess.Popen(
                        [*self.command, str(recipe_file)], cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                        # the log fills as it happens; the process holds the run lock until it ends (and takes it
                        # over: `train` would otherwise refuse the folder this server holds)
                        stdin=subprocess.DEVNULL, env={**self.env(), "PYTHONUNBUFFERED": "1",
                                                       **({} if lock is None else {run_lock.FD: str(lock.fd)})},
                        pass_fds=() if lock is None else (lock.fd,),
                        start_new_session=True,  # its own process group: what it leaves behind is found by that
                    )
                if lock is not None:
                    lock.note(process.pid)  # the holder another start names
            finally:
                if lock is not None:
                    lock.close()
            self.job = Job(self.root, recipe_file, output_dir, log_file, process, started, method)
            threading.Thread(target=_end_leftovers, args=(process,), daemon=True).start()
            if not self._stops_at_exit:
                atexit.register(self._stop_at_exit)
                self._stops_at_exit = True
            return self.job

    def stop(self) -> str:
        with self._lock:
            job = self.job
            if job is None or not job.running():
                return "no job is running"
            if job.stop_requested:  # once: a second SIGTERM would end the process at once, mid-save
                return job.outcome()
            job.stop_requested = True
            said = job.outcome()  # before the signal: a job still loading data has no handler and may be gone at once
            job.process.send_signal(signal.SIGTERM)
            return said

    def _stop_at_exit(self) -> None:
        """The server is exiting (Ctrl-C): stop the job as the Stop button does, and wait for its checkpoint.

        In a process group of its own, the job no longer gets the terminal's Ctrl-C; this stops it instead.
        """
        job = self.job
        if job is None or not job.running():
            return
        print(f"stopping the training job ({job.recipe_file}) first: it saves a checkpoint; Ctrl-C again ends it at once",
              file=sys.stderr, flush=True)
        self.stop()
        try:
            job.process.wait()
        except KeyboardInterrupt:
            os.killpg(job.process.pid, signal.SIGKILL)

    def _claim(self, output_dir: str) -> run_lock.Lock | None:
        """The run lock of the job's output folder, taken without waiting; None where file locks are unavailable."""
        try:
            return run_lock.acquire(self.root / output_dir, log=lambda line: print(line, file=sys.stderr), shown=output_dir)
        except run_lock.Held as e:
            if self.job is not None and e.pid == str(self.job.process.pid):
                raise UserError("the last job's processes are still ending; start again in a moment") from None
            raise


def _end_leftovers(process: subprocess.Popen) -> None:
    """When the job's process has ended, end what it left running in its process group.

    A stop before training begins ends the CLI at once (no handler yet), which would orphan any helper process it
    had started (data loading, a compile pool); those must not keep the machine, or the run lock, busy.
    """
    if not hasattr(os, "killpg"):  # Windows: no process groups to clean up
        process.wait()
        return
    try:
        # Waits without reaping: while the ended process is not reaped, its pid (the group's id) cannot be reused.
        # Reaped by another wait() first (or no waitid: macOS before Python 3.13), the id stays taken while the
        # group has members, which are what is looked for.
        os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
    except (ChildProcessError, AttributeError):
        process.wait()
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing was left
        pass
    process.wait()
