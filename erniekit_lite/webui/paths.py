"""Paths under the directory the UI was started in; paths typed in the UI stay inside it.

A UI reachable over the network (or by anyone logged in with --auth) must not read or write files elsewhere:
every path is resolved (following symlinks, so a link pointing out is caught too) and refused when outside. The one
exception: a recipe's data may be read from the recipes and demo data shipped inside the package
(erniekit_lite.shipped), where a shipped recipe chosen outside a clone finds it, as `erniekit-lite train NAME` does.

Nor may a visitor name code for the server to run. A GRPO reward file must lie inside the directory (not in the UI's
own state folder, where it keeps what visitors send), and a UI others can reach (a host other than loopback, --share
or --auth) runs only the built-in rewards, by name: no reward file and no `package.module:function`.
`trust_remote_code` is refused outright (the ERNIE 4.5 architectures need none). Validate, Preview and Start each
check this first, before anything is imported or loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from erniekit_lite import shipped
from erniekit_lite.errors import UserError
from erniekit_lite.recipe import REWARD_NAMES, Recipe
from erniekit_lite.rewards import reward_file

STATE_DIR = ".erniekit-webui"  # the UI's own state: job copies of recipes and their logs (jobs.py), serve.log
# train: keys (TRL/Trainer fields) that name files or directories
TRAIN_PATH_KEYS = ("resume_from_checkpoint", "deepspeed", "fsdp_config", "accelerator_config", "chat_template_path",
                   "logging_dir")


def confine(root: Path, text: str, what: str, readable: tuple[Path, ...] = ()) -> Path:
    """`text` (relative to `root`, or absolute) resolved; a UserError when empty or outside `root` (and outside
    each of `readable`, folders that may be read from: only ever the package's shipped recipes).

    A Hub id like `baidu/ERNIE-4.5-0.3B-PT` resolves inside `root` and passes; loading then falls back to the Hub.
    """
    if not text or not text.strip():
        raise UserError(f"{what}: empty; enter a path inside {root}")
    path = (root / Path(text.strip()).expanduser()).resolve()
    if not path.is_relative_to(root.resolve()) and not any(path.is_relative_to(r.resolve()) for r in readable):
        raise UserError(f"{what}: {text.strip()} is outside {root}, the directory the web UI was started in; "
                        "use a path inside it")
    return path


def confine_recipe(root: Path, recipe: Recipe, exposed: bool = False) -> None:
    """Every path a recipe reads or writes: model, data sources (which may also be the package's demo data), output
    dir, path-valued train: keys and reward models; and no code the visitor names: no trust_remote_code, reward
    functions only from files inside `root` (or shipped), and none at all when the UI is `exposed` to others."""
    for key, value in (("model.trust_remote_code", recipe.model.trust_remote_code),
                       ("train.trust_remote_code", recipe.train.get("trust_remote_code")),
                       ("train.model_init_kwargs.trust_remote_code",
                        (recipe.train.get("model_init_kwargs") or {}).get("trust_remote_code")
                        if isinstance(recipe.train.get("model_init_kwargs"), dict) else None)):
        if value:
            raise UserError(f"{key}: the web UI runs no code shipped with a checkpoint (ERNIE 4.5 needs none); set it "
                            "to false, or train this recipe from the command line")
    confine(root, recipe.model.path, "model.path")
    for section in ("train", "eval"):
        for i, source in enumerate(getattr(recipe.data, section)):
            confine(root, source.path, f"data.{section}.{i}.path", readable=(shipped.RECIPES,))
    confine(root, recipe.output.dir, "output.dir")
    if recipe.train.get("hub_token"):
        raise UserError("train.hub_token: a token in a recipe is shown to every page of the web UI (the running job's "
                        "recipe); remove it, and push from the Export tab with a token typed there")
    for key in TRAIN_PATH_KEYS:
        if isinstance(recipe.train.get(key), str):
            confine(root, recipe.train[key], f"train.{key}")
    for i, entry in enumerate(recipe.rewards or []):
        if entry.model is not None:
            confine(root, entry.model, f"rewards.{i}.model")
        if entry.function is not None:
            confine_reward(root, entry.function, f"rewards.{i}.function", exposed)


def confine_reward(root: Path, spec: str, key: str, exposed: bool) -> None:
    """A reward function the server may import: a file inside `root` outside its state folder (or a shipped one),
    or an installed `package.module:function`; nothing when the UI is reachable by others."""
    if exposed:
        raise UserError(f"{key}: this web UI is reachable by others (--host, --share or --auth), where only the built-in "
                        f"rewards run (name: {' | '.join(REWARD_NAMES)}); train a recipe with your own reward from "
                        "the command line")
    file = reward_file(spec)
    if file is None:
        return  # an installed module, imported by name as the CLI imports it
    path = confine(root, str(file), key, readable=(shipped.RECIPES,))
    if path.is_relative_to((root / STATE_DIR).resolve()):
        raise UserError(f"{key}: {file} is in the web UI's own state folder ({STATE_DIR}), where it keeps what "
                        "visitors send; use a reward file of your own elsewhere in the directory")


def recipe_files(root: Path) -> list[str]:
    """Recipes under `root/recipes`, relative to `root`; recipes/accelerate/ holds launch configs, not recipes."""
    found = (root / "recipes").rglob("*.yaml")
    return sorted(str(p.relative_to(root)) for p in found if p.relative_to(root).parts[1] != "accelerate")


def recipe_choices(root: Path) -> list[str]:
    """The web UI's recipe list: `root`'s own recipes (recipe_files) and every shipped recipe (shipped.names(), what
    `erniekit-lite recipes` lists) as `recipes/NAME.yaml`; open_recipe finds each as `erniekit-lite train` does."""
    return sorted(set(recipe_files(root)) | {f"{shipped.PREFIX}{name}.yaml" for name in shipped.names()})


def open_recipe(root: Path, choice: str) -> tuple[str, str, bool]:
    """(file name, text, shipped?) of a recipe from the list, found as `erniekit-lite train CHOICE` run in `root`
    finds it (recipe.load): the file under `root` if there is one, else the shipped recipe of that name, its
    `recipes/...` paths that `root` lacks pointed into the package (shipped_text)."""
    if (root / choice).exists() or (root / choice).is_symlink():  # the user's own file: confined as any typed path
        file = confine(root, choice, "recipe")
        return file.name, file.read_text(encoding="utf-8"), False
    found = shipped.find(choice)
    if found is None:
        raise UserError(f"recipe: {choice} is neither a file in {root} nor a shipped recipe (erniekit-lite recipes)")
    return found.name, shipped_text(root, found), True


def shipped_text(root: Path, recipe: Path) -> str:
    """A shipped recipe's YAML, comments kept, with each value shipped.localize changes for a run in `root` (a
    `recipes/...` data file or reward function that `root` lacks) written as the package's path."""
    text = recipe.read_text(encoding="utf-8")
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return text  # shown as it is; the editor reports the error
    changed, todo = [], [node] if node is not None else []
    while todo:
        n = todo.pop()
        if isinstance(n, yaml.ScalarNode):
            new = shipped.localize(n.value, recipe, root)
            if new != n.value:
                changed.append((n.start_mark.index, n.end_mark.index, new))
        elif isinstance(n, yaml.SequenceNode):
            todo += n.value
        elif isinstance(n, yaml.MappingNode):
            todo += [value for _, value in n.value]
    for start, end, new in sorted(changed, reverse=True):
        text = text[:start] + (new if _plain(new) else json.dumps(new)) + text[end:]
    return text


def _plain(value: str) -> bool:
    """Whether `value` reads back as itself written unquoted as a YAML mapping's value."""
    try:
        return yaml.safe_load(f"k: {value}") == {"k": value}
    except yaml.YAMLError:
        return False


def model_dirs(root: Path, depth: int = 3) -> list[str]:
    """Model and run dirs (config.json or adapter_config.json) up to `depth` levels below `root`, relative to it.

    Hidden dirs (the UI's own state) and `checkpoint-N` dirs are skipped to keep the list short; any path inside
    `root` can still be typed.
    """
    found, level = [], [root]
    for _ in range(depth):
        level = [d for parent in level for d in sorted(parent.iterdir())
                 if d.is_dir() and not d.name.startswith(".") and not d.name.startswith("checkpoint-")]
        found += [str(d.relative_to(root)) for d in level
                  if (d / "config.json").is_file() or (d / "adapter_config.json").is_file()]
    return sorted(found)
