"""Putting a finished output where an old one was without losing either, with the permissions the user's umask gives.

An output (a merged model, a pruned one, a GGUF export) is written completely into a staging folder beside its
target first; `replace_dir` then moves the old target aside, renames the new one in and only then deletes the old:
a crash at any point leaves a whole model under the target's name or, the old one, under `.NAME.replaced-PID`.
safetensors' writer creates its files 0600, so a serving account or another user could not read a merged model or
a run while every other file followed the umask: `follow_umask` gives weight files the mode the umask gives.
"""

from __future__ import annotations

import os
import shutil
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


def follow_umask(path: Path) -> None:
    """The `*.safetensors` file `path`, or those directly in folder `path` (what one save wrote: a checkpoint's
    folder is done by its own save), made 0666 less the umask (safetensors writes them 0600)."""
    path = Path(path)
    mode = 0o666 & ~umask()
    files = [path] if path.is_file() else path.glob("*.safetensors") if path.is_dir() else []
    for file in files:
        if file.suffix == ".safetensors" and file.is_file() and not file.is_symlink():
            os.chmod(file, mode)


def replace_dir(staging: Path, target: Path) -> None:
    """`staging`, complete, becomes `target`; an old `target` is moved aside first and deleted last."""
    follow_umask(staging)
    aside = None
    if target.exists():
        aside = target.with_name(f".{target.name}.replaced-{os.getpid()}")
        shutil.rmtree(aside, ignore_errors=True)
        target.rename(aside)
    try:
        staging.rename(target)
    except BaseException:
        if aside is not None:
            aside.rename(target)  # the old one back under its name
        raise
    if aside is not None:
        shutil.rmtree(aside)
