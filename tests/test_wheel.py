"""The package as a user installs it, outside a clone: a wheel built from the repository carries the recipes and the
demo data, and the quick start runs from it by name in an empty folder and learns the identity answers. The web UI
ships inside the package (no top-level `webui`) and lists the same shipped recipes there.

The wheel is installed with `pip install --target` into a folder put first on PYTHONPATH, reusing this environment's
torch and the rest (not a fresh venv: PyPI's Linux torch is the CUDA build). The child prints where erniekit_lite
came from, so the test knows it ran the wheel and not the clone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import IDENTITY

ROOT = Path(__file__).resolve().parents[1]


def run(cwd: Path, site: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


# Run in the user's folder from the wheel: what the web UI's Train tab lists and makes of the quick start
WEB_UI = """
import json
from pathlib import Path
from erniekit_lite import shipped, webui
from erniekit_lite.webui.paths import open_recipe, recipe_choices
from erniekit_lite.webui.train_tab import validate_recipe
root = Path.cwd()
name, text, package = open_recipe(root, "recipes/quickstart.yaml")
print(json.dumps({"webui": webui.__file__, "names": shipped.names(), "choices": recipe_choices(root), "from_package": package,
                  "validated": validate_recipe(root, text, name).splitlines()[-1]}))
"""


@pytest.mark.slow  # builds a wheel (~10 s) and runs the quick start from it (~20 s quiet, minutes on a loaded machine)
def test_the_wheel_carries_the_quick_start_and_it_learns_outside_a_clone(tmp_path):
    # built from a copy of what goes into it: setuptools builds in the tree, and a build/ left there (by an earlier
    # run) would put its stale files into this wheel (a module since moved or deleted)
    source = tmp_path / "source"
    shutil.copytree(ROOT / "erniekit_lite", source / "erniekit_lite", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("erniekit_lite-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {str(p.relative_to(ROOT / "erniekit_lite")) for p in (ROOT / "erniekit_lite" / "recipes").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert {f"erniekit_lite/{name}" for name in shipped} <= names, sorted(shipped)
    # one top-level package (the web UI is erniekit_lite.webui), so no other distribution's `webui` is shadowed
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"erniekit_lite"}
    assert "erniekit_lite/webui/app.py" in names
    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                               capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]

    user = tmp_path / "user"  # an empty folder: no recipes/ here
    user.mkdir()
    where = run(user, site, "-c", "import erniekit_lite; print(erniekit_lite.__file__)")
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr
    listed = run(user, site, "-m", "erniekit_lite", "recipes")
    assert listed.returncode == 0 and any(line.split()[0] == "quickstart" for line in listed.stdout.splitlines()), listed.stdout
    assert run(user, site, "-m", "erniekit_lite", "tiny", "runs/tiny-ernie", "--arch", "dense").returncode == 0
    # the web UI, started here, lists the recipes `erniekit-lite recipes` lists, and the quick start it opens
    # validates through its Validate handler, the demo data read from the package
    ui = run(user, site, "-c", WEB_UI)
    assert ui.returncode == 0, ui.stderr[-3000:]
    seen = json.loads(ui.stdout.strip().splitlines()[-1])
    assert seen["webui"].startswith(str(site)), seen
    assert seen["choices"] == sorted(f"recipes/{name}.yaml" for name in seen["names"]), seen
    assert "recipes/quickstart.yaml" in seen["choices"]
    assert set(seen["names"]) <= {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}, listed.stdout
    assert seen["from_package"] and seen["validated"].endswith("quickstart.yaml: valid"), seen
    trained = run(user, site, "-m", "erniekit_lite", "train", "quickstart")
    assert trained.returncode == 0, trained.stderr[-3000:]
    # the quick start's own check: each sample prompt answered with the identity data's answer, greedily
    answers = {json.loads(line)["prompt"]: json.loads(line)["answer"]
               for line in (user / "runs" / "quickstart" / "samples.jsonl").read_text().splitlines()}
    expected = {r["src"][0]: r["tgt"][0] for r in map(json.loads, IDENTITY.read_text().splitlines()) if len(r["src"]) == 1}
    assert answers and all(answers[p].strip() == expected[p] for p in answers), answers

    copied = run(user, site, "-m", "erniekit_lite", "recipes", "--copy", ".")
    assert copied.returncode == 0 and (user / "recipes" / "quickstart.yaml").read_text() == \
        (ROOT / "erniekit_lite" / "recipes" / "quickstart.yaml").read_text()
    again = run(user, site, "-m", "erniekit_lite", "recipes", "--copy", ".")  # nothing the user has is overwritten
    assert again.returncode == 2 and "nothing copied" in again.stderr
