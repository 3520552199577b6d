"""The recipes and demo data that ship inside the package (`erniekit_lite/recipes`; a clone links it as `recipes/`).

So an installed package has a quick start too: `erniekit-lite train quickstart` names a shipped recipe, and
`erniekit-lite recipes` lists them or copies them out to edit. A shipped recipe names its data as `recipes/...`,
relative to the working directory, as in a clone; where that path is not there (outside a clone, nothing copied
out), it is read from the package instead (`localize`).
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

RECIPES = Path(__file__).resolve().parent / "recipes"
PREFIX = "recipes/"


def names() -> list[str]:
    """Shipped recipe names: their paths under recipes/ without `.yaml` (`quickstart`, `ernie-4.5-0.3b/sft-lora`);
    accelerate's configs are not recipes."""
    return sorted(str(p.relative_to(RECIPES).with_suffix("")) for p in RECIPES.rglob("*.yaml") if p.parent.name != "accelerate")


def find(name: str) -> Path | None:
    """The shipped recipe `name` (with or without `.yaml` or a leading `recipes/`), or None."""
    stem = name.removeprefix(PREFIX).removesuffix(".yaml")
    return RECIPES / f"{stem}.yaml" if stem in names() else None


def summary(name: str, width: int = 110) -> str:
    """The first sentence of a shipped recipe's opening comment: what it is for (its first line alone stopped
    mid-sentence); past `width` characters, without its longest parenthesised asides."""
    lines = (RECIPES / f"{name}.yaml").read_text(encoding="utf-8").splitlines()
    comment = " ".join(line.lstrip("# ").strip() for line in itertools.takewhile(lambda l: l.startswith("#"), lines))
    asides, depth, opened = [], 0, 0
    for i, ch in enumerate(comment):
        if ch == "(" and depth == 0:
            opened = i
        depth += (ch == "(") - (ch == ")")
        if ch == ")" and depth == 0:
            asides.append(comment[opened - 1:i + 1] if comment[opened - 1:opened] == " " else comment[opened:i + 1])
        if ch == "." and depth == 0 and comment[i + 1:i + 2] in ("", " ") and not comment[:i].endswith(("e.g", "i.e")):
            comment = comment[:i + 1]
            break
    for aside in sorted(asides, key=len, reverse=True):
        if len(comment) <= width:
            break
        comment = comment.replace(aside, "", 1)
    return comment


def localize(raw, recipe: Path, cwd: Path | None = None):
    """The recipe's values with each `recipes/...` path (or `recipes/....py:function` reference) that is missing from
    the working directory pointed into the package, for a recipe file that is itself shipped; else unchanged."""
    if RECIPES not in Path(recipe).resolve().parents:
        return raw
    cwd = cwd or Path.cwd()

    def fix(value):
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, str) and value.startswith(PREFIX):
            file, sep, rest = value.partition(":")
            if not (cwd / file).exists() and (RECIPES / file.removeprefix(PREFIX)).exists():
                return str(RECIPES / file.removeprefix(PREFIX)) + sep + rest
        return value

    return fix(raw)


def copy_to(folder: Path) -> Path:
    """Copy every shipped recipe and data file to `folder`/recipes, where `recipes/...` paths find them when the
    commands run from `folder`. Refuses, naming one, if any file would be overwritten."""
    target = Path(folder) / "recipes"
    files = [p for p in RECIPES.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    taken = [target / p.relative_to(RECIPES) for p in files if (target / p.relative_to(RECIPES)).exists()]
    if taken:
        from erniekit_lite.errors import UserError

        raise UserError(f"recipes --copy: {taken[0]} exists ({len(taken)} file(s) would be overwritten); nothing copied")
    for p in files:
        (target / p.relative_to(RECIPES)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, target / p.relative_to(RECIPES))
    return target
