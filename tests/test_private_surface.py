"""docs/development.md's table of other libraries' internals: each row names the version it was read at; when an
installed library differs, the rows to re-read are named. (A guard on the table's currency, not on behaviour: what
each internal does is tested where it is used.)"""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"transformers": "transformers", "TRL": "trl", "peft": "peft", "accelerate": "accelerate", "torch": "torch"}


def rows() -> list[tuple[str, str, str]]:
    text = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    table = text[text.index("| library | read at | internal |"):].split("\n\n")[0]
    return [tuple(cell.strip() for cell in line.strip("|").split("|")[:3]) for line in table.splitlines()[2:]]


def test_the_private_surface_was_read_at_the_installed_versions():
    found = rows()
    assert len(found) >= 20 and {library for library, _, _ in found} == set(PACKAGES)
    stale = [f"{library} {read} (installed {version(PACKAGES[library]).split('+')[0]}): {internal}"
             for library, read, internal in found
             if not version(PACKAGES[library]).split("+")[0].startswith(read if library != "torch" else read.rsplit(".", 1)[0])]
    assert not stale, "re-read these rows of docs/development.md against the installed version:\n" + "\n".join(stale)


def test_torch_is_a_range_only_as_wide_as_what_is_tested():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'"torch>=2\.11,<2\.14"', pyproject)
