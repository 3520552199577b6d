"""Putting a finished output where an old one was without losing either, with the permissions the user's umask gives.

An output (a merged model, a pruned one, a GGUF export) is written completely into a staging folder of its own
beside its target first (`staging_dir`: unique per call, so two writers of one target, say `serve RUN` merging
while the web UI merges the same run, never share one); `replace_dir` then moves the old target aside, renames the
new one in and only then deletes the old: a crash at any point leaves a whole model under the target's name or, the
old one, under `.NAME.replaced-<pid>-<unique>`.

One permission rule for everything made for the user (`for_user`): a file 0666 and a folder 0777, less the umask.
safetensors' writer creates its files 0600 and mkstemp/mkdtemp 0600/0700, which would keep a serving account, a
shared cache's other users or the user's group out while every other file followed the umask.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path


def umask() -> int:
    """The process's umask, read without changing it where /proc says it (os.umask alone can only set it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


def for_user(path: Path) -> Path:
    """`path` (a file or a folder, not a link) given the mode the umask gives what the user makes: 0666 for a file,
    0777 for a folder, less the umask."""
    path = Path(path)
    if not path.is_symlink():
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask())
    return path


def follow_umask(path: Path) -> None:
    """`for_user` on the `*.safetensors` file `path`, or on those directly in folder `path` (what one save wrote: a
    checkpoint's folder is done by its own save)."""
    path = Path(path)
    files = [path] if path.is_file() else path.glob("*.safetensors") if path.is_dir() else []
    for file in files:
        if file.suffix == ".safetensors" and file.is_file():
            for_user(file)


def unique(target: Path, what: str) -> Path:
    """A name beside `target` no other call takes: `.NAME.WHAT-<pid>-<random>` (the process id tells which are stale)."""
    return target.with_name(f".{target.name}.{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def staging_dir(target: Path, what: str) -> Path:
    """A new empty folder beside `target`, this call's own, to write an output into before `replace_dir`. Staging
    folders of the same target that a killed call left (its process gone) are removed first."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for left in target.parent.glob(f".{target.name}.{what}-*"):
        pid = left.name.rsplit("-", 2)[-2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(left, ignore_errors=True)
    return for_user(Path(tempfile.mkdtemp(prefix=f".{target.name}.{what}-{os.getpid()}-", dir=target.parent)))


@contextmanager
def staged(target: Path, what: str):
    """A `staging_dir` for `target` to write into; when the block ends it becomes `target` (`replace_dir`), and when
    the block or the replacing fails it is removed: nothing is left beside the target but, at worst, the old one aside."""
    staging = staging_dir(target, what)
    try:
        yield staging
        replace_dir(staging, target)  # a failure here has put the old target back (replace_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another account's process
        return True
    return True


def replace_dir(staging: Path, target: Path) -> None:
    """`staging`, complete, becomes `target`; an old `target` is moved aside first and deleted last. Two writers of
    one target (two merges of one run): each moves aside what holds the name when it renames, so the last one's stays
    and nothing is left beside it."""
    follow_umask(staging)
    asides = []
    try:
        while True:
            if target.exists():
                aside = unique(target, "replaced")
                try:
                    target.rename(aside)
                    asides.append(aside)
                except FileNotFoundError:  # another writer moved it aside first
                    pass
            try:
                staging.rename(target)
                break
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                # another writer's folder took the name in between: it goes aside too, and this one in
    except BaseException:
        if asides and not target.exists():
            asides[0].rename(target)  # the old one back under its name
            asides.pop(0)
        raise
    for aside in asides:
        shutil.rmtree(aside)  # a failure here raises, and leaves the old one beside the new
