"""Data preparation in a launched run of several processes: each machine's main process prepares a split first and
the machine's other processes read what it wrote, so a node of 8 processes tokenizes once, not 8 times.

What the others read: the cache entry (data/cache.py, or pt's piece folder) when the main process could write one,
else a hand-off beside the run dir (`session(beside=...)`), named per run dir, split and machine, removed once every process has
read it. A process that finds neither prepares the split itself (same result, only slower). Used by every
`prepare_*` (sft, pairs, feedback, pt documents, GRPO prompts); outside a launched run all of this is a no-op.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path



def launched():
    """accelerate's state in a launched run of several processes (the Trainer arguments made it, with their
    `ddp_timeout` for the waits here); None otherwise."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import PartialState

    state = PartialState()
    return state if state.num_processes > 1 else None


@contextmanager
def session(beside: Path | None = None):
    """One `prepare_*` call, its hand-offs beside the run dir `beside` (in its parent: the run dir is claimed only
    after the data is ready, so a data error leaves nothing in it); None: no hand-offs. They are removed once every
    process has read them (a barrier on success; on an error each process is on its own, and a reader that finds no
    hand-off prepares the split itself). Removing a piece folder that processes have memory-mapped is safe: the
    mapping outlives the name."""
    hand = HandOff(beside)
    try:
        yield hand
        if hand.state is not None and hand.beside is not None:  # every process, wrote or read: all pass the barrier
            hand.state.wait_for_everyone()
    finally:
        for path in hand.handed:
            _remove(path)


class HandOff:
    """The hand-offs of one `session`: each split asks for its own (`next`), in the same order on every process."""

    def __init__(self, beside: Path | None = None):
        self.state = launched()
        self.beside = None if beside is None else Path(beside).expanduser()  # the run dir whose parent takes them
        self.splits = 0
        self.handed: list[Path] = []  # what this process wrote, removed when the session ends

    @property
    def writer(self) -> bool:
        """This process prepares first and hands off (a launched run's local main process)."""
        return self.state is not None and self.state.is_local_main_process

    @property
    def reader(self) -> bool:
        """This process reads what its machine's main process wrote."""
        return self.state is not None and not self.state.is_local_main_process

    @contextmanager
    def main_first(self):
        """Each machine's main process runs the block first; the machine's others run it after (every process
        passes the same barrier, as in accelerate's `local_main_process_first`). The main process reaches the barrier
        even when the block raises (a data mistake): the others then run the block and stop on the same one-line
        error, instead of a collective error when the main process is gone."""
        if self.state is None:
            yield
        elif not self.state.is_local_main_process:
            self.state.wait_for_everyone()
            yield
        else:
            try:
                yield
            finally:
                self.state.wait_for_everyone()

    def next(self) -> Path | None:
        """The next split's hand-off path, without suffix: per run dir, split and machine (named by its first
        process's rank; several machines may share the folder); None when this run has none. The writer removes what
        a crashed run left under that name, so it is never read."""
        self.splits += 1
        if self.state is None or self.beside is None:
            return None
        machine = self.state.process_index - self.state.local_process_index
        path = self.beside.parent / f".{self.beside.name}.data-{self.splits}-m{machine}"
        if self.writer:
            for stale in [path, *path.parent.glob(path.name + ".*")] if path.parent.is_dir() else []:
                _remove(stale)
        return path

    def written(self, path: Path) -> None:
        """`path` was handed off: removed at the end of the session."""
        self.handed.append(path)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
