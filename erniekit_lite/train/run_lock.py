"""A run holds its output folder: one `train` into a folder at a time.

The lock is a file beside the folder, `.NAME.lock` (as the overwrite's `.NAME.replaced-*` aside and the data
hand-offs), never in it: an overwrite moves the folder aside with its contents, pushes upload the folder, and
rundir's tables say what a run folder holds. It is an `fcntl.flock` on that file, taken without waiting and held
while the run lives: the OS lets it go when the process ends however it ends, so a killed run never blocks the next.
The holder writes `PID HOST` into the file, for the refusal to name it. A run that ends unlinks the file while it
still holds the lock (a taker checks that the file it locked is still the one at the path); one that was killed
leaves it, and the next run takes it.

Who takes it: the `train` command of a single process, or the launching command of a multi-process run (machine 0's,
with several machines), before anything heavy loads or anything is written; the processes it launches see
`HELD` in their environment and leave it to it. Under a launcher of the user's own (`torchrun`, `accelerate launch`),
the process of global rank 0 takes it. The web UI takes it when it starts a job and hands it to the job's process
(`FD`): one lock, whichever started the run. Forked children (data loader workers) close their copy: only the
holder's life holds it.

Without `fcntl` (Windows) there is no lock, and two runs into one folder are not refused; a folder whose parent
cannot be written (or whose filesystem has no locks) runs without one, said in one line.
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from erniekit_lite.errors import UserError

try:
    import fcntl
except ImportError:  # Windows: no lock (see above)
    fcntl = None

HELD = "ERNIEKIT_RUN_LOCK_HELD"  # the lock file a launching process holds for the processes it starts
FD = "ERNIEKIT_RUN_LOCK_FD"  # a descriptor of the lock handed to this process (the web UI's job)


def lock_path(out: str | Path) -> Path | None:
    """The lock file of the output folder `out`, beside it; None for a folder with no name (a filesystem root)."""
    target = Path(out).resolve()
    return target.parent / f".{target.name}.lock" if target.name else None


class Lock:
    """A held run lock: `fd` is flock'ed on `path`; `made` are the folders taking it created (removed if left empty)."""

    def __init__(self, path: Path, fd: int, made: list[Path]):
        self.path, self.fd, self.made, self.owner = path, fd, made, os.getpid()

    def note(self, pid: int) -> None:
        """Write who holds it (`PID HOST`), for the refusal of another start."""
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{pid} {socket.gethostname()}\n".encode(), 0)

    def close(self) -> None:
        """Let go of this copy, leaving the file: the lock stays held while another copy is open (the one a process
        it was handed to holds: `fd` passed to it, with `FD` naming it in its environment)."""
        _held.discard(self)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def release(self) -> None:
        """The run has ended: remove the file while still holding it, then let go."""
        if self.fd < 0 or os.getpid() != self.owner:
            return
        try:
            if _same_file(self.path, self.fd):
                self.path.unlink()
        except OSError:
            pass
        self.close()
        for folder in reversed(self.made):  # deepest last made: the run folder's parents, if nothing else came
            try:
                folder.rmdir()
            except OSError:
                break


_held: set[Lock] = set()


def _drop_in_child() -> None:
    """A forked child (a data loader worker) holds no copy: the lock lives exactly as long as its holder."""
    for lock in list(_held):
        try:
            os.close(lock.fd)
        except OSError:
            pass
        lock.fd = -1
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_in_child)


def _same_file(path: Path, fd: int) -> bool:
    try:
        on_disk, ours = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (on_disk.st_dev, on_disk.st_ino) == (ours.st_dev, ours.st_ino)


class Held(UserError):
    """Another process holds the run lock: `pid` as its holder wrote it ("" if it had not yet), `host` its machine."""

    def __init__(self, out: str | Path, pid: str, host: str):
        self.pid, self.host = pid, host
        who = f"pid {pid}" + (f" on {host}" if host and host != socket.gethostname() else "") if pid else \
            "a process that has not written its pid yet"
        super().__init__(f"output.dir: {out} is in use by another run ({who}); wait until it ends, "
                         "or choose another output.dir")


def _holder(fd: int) -> tuple[str, str]:
    """(pid, host) of the holder of the lock open on `fd`, as it wrote them."""
    text = ""
    for _ in range(20):  # a holder that has just taken it writes its pid at once
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        if text:
            break
        time.sleep(0.05)
    pid, _, host = text.partition(" ")
    return pid, host


def acquire(out: str | Path, log=print, shown: str | None = None) -> Lock | None:
    """Take the run lock of `out` without waiting; `Held`, naming the holder's pid, if another process has it (`out`
    said as `shown`). None where there can be no lock (no fcntl, a parent that cannot be written, a filesystem
    without locks)."""
    shown = str(out) if shown is None else shown
    if fcntl is None:
        return None
    path = lock_path(out)
    if path is None:
        return None
    made = []
    try:
        for folder in reversed([path.parent, *path.parent.parents]):
            if not folder.exists():
                try:
                    folder.mkdir()
                except FileExistsError:  # another start made it meanwhile
                    continue
                made.append(folder)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid, host = _holder(fd)
                os.close(fd)
                raise Held(shown, pid, host) from None
            except OSError:
                os.close(fd)
                raise
            if _same_file(path, fd):
                break
            os.close(fd)  # its holder removed it as it ended (`release`): take the new one
    except OSError as e:
        for folder in reversed(made):
            try:
                folder.rmdir()
            except OSError:
                break
        log(f"output.dir: {shown} runs without a lock ({e}): a second train into it at once is not refused")
        return None
    lock = Lock(path, fd, made)
    lock.note(os.getpid())
    _held.add(lock)
    return lock


def _adopt(path: Path) -> Lock | None:
    """The lock of `path` as handed to this process (`FD`), or None when none was or it is another folder's."""
    given = os.environ.pop(FD, None)
    if given is None or fcntl is None:
        return None
    try:
        fd = int(given)
    except ValueError:
        return None
    if not _same_file(path, fd):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held already through this very descriptor: a no-op
    except OSError:
        return None
    os.set_inheritable(fd, False)
    lock = Lock(path, fd, [])
    lock.note(os.getpid())
    _held.add(lock)
    return lock


def takes(machine_rank: int | None) -> bool:
    """Whether this process takes the run lock: not a launched process whose launcher holds it, nor one of rank above
    0 (another machine's launcher, or a worker of a launch that is not ours); `machine_rank` is this command's."""
    if "LOCAL_RANK" in os.environ:  # a launched process
        return HELD not in os.environ and os.environ.get("RANK", "0") == "0"
    return not machine_rank


@contextmanager
def hold(out: str | Path, take: bool = True, log=print):
    """Hold the run lock of `out` for the block, or the one handed to this process (`FD`); `Held` (a UserError naming
    the holder) if another run has it. The processes the block starts are told (`HELD`): a launch's workers leave it
    to this process. `take` False: hold nothing (`takes`)."""
    path = lock_path(out) if take else None
    lock = None
    if path is not None:
        lock = _adopt(path) or acquire(out, log)
    before = os.environ.get(HELD)
    if lock is not None:
        os.environ[HELD] = str(lock.path)
    try:
        yield lock
    finally:
        if lock is not None:
            if before is None:
                os.environ.pop(HELD, None)
            else:
                os.environ[HELD] = before
            lock.release()
