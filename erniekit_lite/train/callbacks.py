"""Trainer callbacks of every run: a progress file others can follow, and a stop that keeps the work done.

`OUTPUT_DIR/progress.jsonl` gets one JSON object per line: `{"event": "start", "max_steps"}`, one `"log"` event per
logging step (the Trainer's logs: loss, learning_rate, tokens_per_second, eval_loss, rewards/*, aux_loss, ...), and
an `"end"` event with `status` finished or stopped and the checkpoint to resume from. The web UI reads it.

SIGTERM or Ctrl-C (SIGINT) during training does not kill the step in flight: the optimizer step finishes, a
checkpoint is saved, and the run ends with `Stopped` (exit status 128 + signal). A second Ctrl-C interrupts at once.
A non-finite gradient (NaN/inf loss) ends the run before that step is applied, with exit status 3 and an `"end"`
event of status `diverged` naming the last checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from erniekit_lite.errors import Stopped, UserError
from erniekit_lite.train import checkpoints, rundir

PROGRESS = "progress.jsonl"
DIVERGED = 3  # exit status of a run stopped by a NaN/inf loss


def write_event(out: Path, event: str, state, **fields) -> None:
    if not state.is_world_process_zero:
        return
    record = {"event": event, "step": state.global_step, "max_steps": state.max_steps, "time": round(time.time(), 3), **fields}
    with open(Path(out) / PROGRESS, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


class FirstStep(TrainerCallback):
    """The run an overwrite moved aside is deleted once the new run's first optimizer step has finished (rundir)."""

    def __init__(self, claimed: rundir.Claimed):
        self.claimed = claimed

    def on_step_end(self, args, state, control, **kwargs):
        self.claimed.first_step_done()


class ProgressLog(TrainerCallback):
    def __init__(self, out: Path):
        self.out = out

    def on_train_begin(self, args, state, control, **kwargs):
        write_event(self.out, "start", state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        write_event(self.out, "log", state, **{"epoch": state.epoch, **(logs or {})})


def log_line(logs: dict, step: int, max_steps: int) -> str:
    """One logged step as text: `step 25/150: loss 4.732, grad_norm 2.513, ...` (transformers prints a Python dict)."""
    shown = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in logs.items()
             if k != "total_flos" and not isinstance(v, (dict, list))]
    return f"step {step}/{max_steps}: {', '.join(shown)}"


class ProgressLines(ProgressCallback):
    """transformers' progress bar on a terminal only: in a pipe (the web UI's log pane, a job's log file) its redraws
    were raw text. Each log is a `log_line`, and while the bar is up other lines print above it, not inside it."""

    def __init__(self):
        super().__init__()
        self.bar = sys.stderr.isatty()
        self._above = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.current_step = 0
        if self.bar:
            super().on_train_begin(args, state, control, **kwargs)
            if self.training_bar is not None:
                self._above = contextlib.redirect_stdout(_AboveTheBar())
                self._above.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            super().on_step_end(args, state, control, **kwargs)

    def on_prediction_step(self, args, state, control, **kwargs):
        if self.bar:
            super().on_prediction_step(args, state, control, **kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            print(log_line(logs, state.global_step, state.max_steps), flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self._above is not None:
            self._above.__exit__(None, None, None)
            self._above = None
        if self.training_bar is not None:
            super().on_train_end(args, state, control, **kwargs)


class _AboveTheBar:
    """stdout for while the bar is up: whole lines through tqdm.write, which clears the bar, prints, redraws it."""

    def __init__(self):
        self.partial = ""

    def write(self, text: str) -> int:
        from tqdm.auto import tqdm

        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            tqdm.write(line, file=sys.__stdout__)
        return len(text)

    def flush(self) -> None:
        sys.__stdout__.flush()


def show_progress(trainer) -> None:
    """`ProgressLines` in place of transformers' bar and its dict printer (the CLI turns transformers' other bars,
    loading's and saving's, off in a pipe)."""
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(ProgressLines())


class StopOnSignal(TrainerCallback):
    """Turns SIGTERM/SIGINT into "save a checkpoint after this step and stop"."""

    def __init__(self):
        self.signal: int | None = None  # the signal this process received
        self.stopped = False  # training stopped early because some process was signalled
        self._group = None  # launched: the processes' group over host memory (gloo) the flag is summed in

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
            yield
            return
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

        def note(signum, frame):
            self.signal = signum
            signal.signal(signum, previous[signum])  # a second signal acts at once

        for s in previous:
            signal.signal(s, note)
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def on_train_begin(self, args, state, control, **kwargs):
        import torch

        if torch.distributed.is_available() and torch.distributed.is_initialized():  # every process, at the same point
            gloo = torch.distributed.get_backend() == "gloo"
            self._group = torch.distributed.group.WORLD if gloo else torch.distributed.new_group(backend="gloo")

    def on_step_end(self, args, state, control, **kwargs):
        if self._anywhere():
            control.should_save = True
            control.should_training_stop = True
            self.stopped = True

    def _anywhere(self) -> bool:
        """Whether any process was signalled: all must stop after the same step, or a collective would hang."""
        import torch

        if self._group is None:
            return self.signal is not None
        # Summed in host memory over gloo (under NCCL a group of its own): reading a GPU tensor every step would wait
        # for the device to finish the step's work; `.numpy()` reads the host tensor where it lies
        flag = torch.tensor([1 if self.signal is not None else 0])
        torch.distributed.all_reduce(flag, group=self._group)
        return bool(flag.numpy()[0])


def train(trainer, out: Path, resume_from_checkpoint=None):
    """`trainer.train()` with the progress file, resuming (`auto`: the newest complete checkpoint) and the graceful
    stop; raises `Stopped` after a stop's checkpoint or when the loss diverged."""
    say = print if trainer.is_world_process_zero() else (lambda *a: None)
    if trainer.args.should_save:
        checkpoints.remove_partial(Path(out), say)
    resume = checkpoints.resume_point(resume_from_checkpoint, Path(out), say)
    for extra in ("ema", "sync"):  # what they saved in the checkpoint (ema.py, sync.py)
        if getattr(trainer, extra, None) is not None:
            getattr(trainer, extra).resume = Path(resume) if resume else None
    trainer.add_callback(ProgressLog(out))
    show_progress(trainer)
    stop = StopOnSignal()
    trainer.add_callback(stop)
    try:
        with stop.installed():
            result = trainer.train(resume_from_checkpoint=resume)
    except UserError:  # e.g. the first step out of memory (step.ErnieTrainer.training_step): its line after the bar's
        trainer.callback_handler.on_train_end(trainer.args, trainer.state, trainer.control)
        raise
    except checkpoints.Diverged as e:
        trainer.callback_handler.on_train_end(trainer.args, trainer.state, trainer.control)  # closes the progress bar
        found = checkpoints.complete(Path(out))
        last = str(found[-1]) if found else None
        write_event(out, "end", trainer.state, status="diverged", checkpoint=last)
        raise Stopped(
            DIVERGED,
            f"error: training diverged at step {e.step} of {trainer.state.max_steps}: loss {e.loss:g}, gradient norm "
            f"{e.grad_norm:g}; the step was not applied, and "
            + (f"the last checkpoint, {last}, is from before it" if last else "no checkpoint was saved before it"),
        ) from None
    if stop.stopped:
        # Saved, and every process is past the checkpoint's last barrier. On a machine whose launcher was not
        # signalled (the stop came from another machine), torch elastic takes this machine's first worker to exit
        # 128 + signal for a failure and SIGTERMs the others, which would die mid-exit (before rank 0 writes the end
        # event); ignored from here, each exits with the stop's status on its own. Only in launched workers: a
        # process that goes on after `train` (a test calling main()) keeps its handlers.
        if os.environ.get("LOCAL_RANK") is not None:
            ignore_stop_signals()
        state = trainer.state
        checkpoint = Path(out) / f"checkpoint-{state.global_step}"
        write_event(out, "end", state, status="stopped", checkpoint=str(checkpoint))
        raise Stopped(
            128 + (stop.signal or signal.SIGTERM),
            f"stopped at step {state.global_step} of {state.max_steps}: checkpoint saved in {checkpoint}; to go on, run "
            f"the same command with --resume (or train.resume_from_checkpoint={checkpoint})",
        )
    return result


def ignore_stop_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)


def finished(out: Path, state) -> None:
    write_event(out, "end", state, status="finished", checkpoint=None)


@contextlib.contextmanager
def signals_held():
    """SIGTERM/SIGINT received inside the block are held until it ends; yields the list of those received."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in previous:
        signal.signal(s, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def save_final(trainer, out: Path, metrics: dict, expert_load=None) -> None:
    """The trained model (or adapter), train_results.json and trainer_state.json, with a stop held back until all
    are written: SIGTERM or Ctrl-C here never leaves a half-written model in the run dir."""
    with signals_held() as received:
        trainer.save_model(str(out))  # from the main process only, with the tokenizer, gathering sharded weights
        trainer.save_metrics("train", metrics)  # train_results.json
        trainer.save_state()  # trainer_state.json with log_history
        if expert_load is not None:
            expert_load.save(out, trainer.is_world_process_zero())
        if getattr(trainer, "ema", None) is not None:  # train.ema: OUTPUT/ema, a run dir of the EMA weights (ema.py)
            trainer.ema.write_run(trainer, out, metrics)
    if received:
        finished(out, trainer.state)
        raise Stopped(128 + received[0], f"stopped after the final save: the trained model is complete in {out} "
                                         "(sample prompts and the Hub push were skipped)")
