"""`files.replace_dir`: the old output is moved aside before the new one is renamed in and deleted only after, so a
failure at any step leaves a whole one (tests/test_chat_merge.py checks merge's use of it, and the umask)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from erniekit_lite.files import replace_dir


def folders(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_text("old")
    (tmp_path / ".out.staging").mkdir()
    (tmp_path / ".out.staging" / "model.safetensors").write_text("new")
    return tmp_path / ".out.staging", tmp_path / "out"


def test_the_new_output_takes_the_old_ones_place(tmp_path):
    staging, target = folders(tmp_path)
    replace_dir(staging, target)
    assert (target / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failed_rename_puts_the_old_output_back(tmp_path, monkeypatch):
    staging, target = folders(tmp_path)
    rename = Path.rename

    def failing(self, to):
        if self == staging:
            raise OSError("stand-in")
        return rename(self, to)

    monkeypatch.setattr(Path, "rename", failing)
    with pytest.raises(OSError):
        replace_dir(staging, target)
    assert (target / "model.safetensors").read_text() == "old" and (staging / "model.safetensors").read_text() == "new"


def test_a_failed_delete_of_the_old_output_leaves_both(tmp_path, monkeypatch):
    staging, target = folders(tmp_path)
    rmtree = shutil.rmtree

    def failing(path, ignore_errors=False, **kwargs):  # the old one's final delete (a stale aside is cleared quietly)
        if not ignore_errors:
            raise OSError("stand-in")
        return rmtree(path, ignore_errors=ignore_errors, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", failing)
    with pytest.raises(OSError):
        replace_dir(staging, target)
    (aside,) = tmp_path.glob(".out.replaced-*")
    assert (target / "model.safetensors").read_text() == "new" and (aside / "model.safetensors").read_text() == "old"


def test_each_call_stages_in_a_folder_of_its_own(tmp_path):
    """Two writers of one target (`serve RUN` merging while the web UI merges it, two Merge clicks: threads of one
    process) never share a staging folder or an aside; a staging folder a killed call left is removed by the next
    call, one whose process still runs is not."""
    import os
    import threading

    from erniekit_lite.files import staged, staging_dir

    target = tmp_path / "merged"
    first, second = staging_dir(target, "merging"), staging_dir(target, "merging")
    assert first != second and first.is_dir() and second.is_dir() and not list(first.iterdir())
    assert first.name.startswith(f".merged.merging-{os.getpid()}-")
    dead = tmp_path / ".merged.merging-999999999-leftover"
    dead.mkdir()
    third = staging_dir(target, "merging")
    assert not dead.exists() and first.is_dir() and second.is_dir()  # ours are alive
    for folder in (first, second, third):
        folder.rmdir()

    start = threading.Barrier(2)
    errors = []

    def merge(text: str) -> None:
        try:
            with staged(target, "merging") as staging:
                (staging / "model.safetensors").write_text(text)
                start.wait()  # both staged before either replaces
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    target.mkdir()
    (target / "model.safetensors").write_text("old")
    threads = [threading.Thread(target=merge, args=(text,)) for text in ("one", "two")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert (target / "model.safetensors").read_text() in ("one", "two")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # no staging folder or aside left

    with pytest.raises(RuntimeError):
        with staged(target, "merging") as staging:
            (staging / "half.bin").write_text("x")
            raise RuntimeError("stand-in: the merge failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"] and (target / "model.safetensors").is_file()


def test_one_permission_rule_for_what_is_made_for_the_user(tmp_path):
    """Under umask 027: the EMA's checkpoint file, a data cache entry and a staged output folder get 0640 / 0750
    (safetensors and mkstemp/mkdtemp would make them 0600 / 0700; the cache forced 0644 whatever the umask)."""
    import os
    import stat

    import torch

    from erniekit_lite.data import cache
    from erniekit_lite.data.tokenize import Sample
    from erniekit_lite.files import staged
    from erniekit_lite.train.ema import FILE, WeightEma

    def mode(path: Path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    old = os.umask(0o027)
    try:
        ema = WeightEma(decay=0.9, start=0)
        ema.attach(torch.nn.Linear(2, 2))
        (tmp_path / "checkpoint-1").mkdir()
        ema.save(tmp_path / "checkpoint-1")
        entry = cache.Entry(samples=[Sample(input_ids=[1, 2], labels=[-100, 2])], meta={})
        saved = cache.store("k" * 40, entry, root=tmp_path / "cache")
        with staged(tmp_path / "merged", "merging") as staging:
            (staging / "model.safetensors").write_text("x")
    finally:
        os.umask(old)
    assert mode(tmp_path / "checkpoint-1" / FILE) == 0o640
    assert mode(saved) == 0o640
    assert mode(tmp_path / "merged") == 0o750
