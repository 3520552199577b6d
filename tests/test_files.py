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
