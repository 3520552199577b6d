"""The one gate every value a web UI visitor sends passes through before any handler sees it.

Each event handler is registered through `Gate.endpoint(kind, ...)`, which names the kind of each of its inputs;
the gate admits every value by its kind (confining it to the directory the UI was started in, or refusing it) and
only then calls the handler, so a handler cannot reach a subprocess or a loader with a value the gate has not seen.
A refusal is the handler's own "error: ..." line. tests/test_webui_gate.py walks every registered endpoint and fails
on an input without a kind, or a path-like one declared `plain`.

The kinds (a trailing `?` lets a blank value through as ""):

    plain     names nothing: a message, task settings, a number, a switch, a choice from a fixed list, a chat history
    state     the page's server-side state (gr.State): never sent by a visitor
    draft     the recipe being edited, or one form field's value: parsed into the YAML and shown, never loaded or run
    recipe    a recipe to validate, preview or train (with its `name`): parsed, then every path it names confined
              (paths.confine_recipe) and, on a UI others reach, no Hub model, dataset or push and no reward code
    name      the recipe's file name (state), read with `recipe`
    choice    a recipe from the list: the user's own file inside the folder, or a shipped recipe (paths.open_recipe)
    model     a model or run folder to load or read: inside the folder; a Hub id only on loopback
    output    a folder to write: inside the folder, not the UI's own state folder
    code      a file or folder the server would import Python from (lm-eval task YAMLs run `!function`s): confined on
              loopback, refused on a UI others reach
    tasks     lm-eval task names: names only, never a file
    identity  a Hub repository to push to (USER/NAME)
    token     a Hub token typed for one push: on a UI others reach, a push needs one (the server's own login is not lent)
    upload    a file Gradio received in this request: inside Gradio's upload folder

Images named inside data records are confined by the data reader itself (`confine_images`, data/vl.py): they are
read while a recipe's data loads, here for Validate and Preview and in the training process for Start.
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from erniekit_lite import shipped
from erniekit_lite.errors import UserError
from erniekit_lite.webui.paths import STATE_DIR, confine, confine_recipe, open_recipe

KINDS = ("plain", "state", "draft", "recipe", "name", "choice", "model", "output", "code", "tasks", "identity", "token",
         "upload")
EXPOSED = "this web UI is reachable by others (--host, --share or --auth)"
# train: keys that push to the Hub (besides every hub_* key): TRL's and transformers' own
PUSHING = frozenset({"push_to_hub", "log_completions_hub_repo"})
TASK_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


@dataclass(frozen=True)
class Checked:
    """A recipe the gate admitted: its text (what the job runs), its file name and the parsed recipe."""

    text: str
    name: str
    recipe: object  # recipe.Recipe


@dataclass(frozen=True)
class Gate:
    root: Path  # the directory the UI was started in
    exposed: bool = False  # others can reach it (app.reachable_by_others)

    def endpoint(self, *kinds: str, refuse: Callable[[str], object] = lambda line: f"error: {line}"):
        """Register a handler: `kinds` names each input's kind (in order); `refuse` turns a refusal's line into
        the handler's outputs. The handler receives the admitted values."""
        for kind in kinds:
            if kind.rstrip("?") not in KINDS:
                raise ValueError(f"unknown kind {kind!r}")

        def wrap(fn):
            if inspect.isgeneratorfunction(fn):
                def handler(*values):
                    try:
                        admitted = self._admit_all(kinds, values)
                    except UserError as e:
                        yield refuse(str(e))
                        return
                    yield from fn(*admitted)
            else:
                def handler(*values):
                    try:
                        admitted = self._admit_all(kinds, values)
                    except UserError as e:
                        return refuse(str(e))
                    return fn(*admitted)
            handler.__name__ = handler.__qualname__ = fn.__name__  # the API name Gradio gives the event
            handler.__doc__ = fn.__doc__
            handler.gate_kinds = kinds
            return handler

        return wrap

    def _admit_all(self, kinds: tuple[str, ...], values: tuple) -> list:
        if len(values) != len(kinds):
            raise UserError(f"expected {len(kinds)} values, got {len(values)}")
        name = next((v for k, v in zip(kinds, values) if k == "name"), "recipe.yaml")
        return [self.admit(kind, value, name) for kind, value in zip(kinds, values)]

    def admit(self, kind: str, value, name: str = "recipe.yaml"):
        """`value` as the handler may use it, or a UserError saying why not (one line)."""
        optional, kind = kind.endswith("?"), kind.rstrip("?")
        if kind in ("plain", "state", "draft", "name"):
            return value
        text = value.strip() if isinstance(value, str) else value
        if optional and not text:
            return None if kind in ("choice", "upload") else ""
        if kind == "recipe":
            return self.recipe(value, name)
        if not isinstance(text, str) and kind != "upload":
            raise UserError(f"{kind}: expected text")
        if kind in ("model", "output", "code") and text.startswith("-"):  # never taken as a subprocess's option
            raise UserError(f"{text}: a path starting with '-'; write it as ./{text}")
        if kind == "choice":
            return open_recipe(self.root, text)
        if kind == "model":
            return self.model(text, "model")
        if kind == "output":
            path = confine(self.root, text, "output folder")
            if path.is_relative_to((self.root / STATE_DIR).resolve()):
                raise UserError(f"{text}: the web UI's own state folder ({STATE_DIR}); choose another folder")
            return text
        if kind == "code":
            if self.exposed:
                raise UserError(f"{text}: {EXPOSED}, where no file of Python the server would import is taken (lm-eval "
                                "task YAMLs can run `!function`s); run it from the command line")
            self._not_state(confine(self.root, text, "folder"), text, "folder")
            return text
        if kind == "tasks":
            names = [t.strip() for t in text.split(",") if t.strip()]
            bad = next((t for t in names if not TASK_NAME.fullmatch(t) or t.endswith((".yaml", ".yml"))), None)
            if not names or bad is not None:
                raise UserError(f"tasks: {bad or text!r} is not an lm-eval task name (names only, comma-separated; local "
                                "task YAMLs go in the task folder)")
            return ",".join(names)
        if kind == "identity":
            from erniekit_lite.hub import settings

            return settings(text).repo_id
        if kind == "token":
            if self.exposed and not text:
                raise UserError(f"token: {EXPOSED}, where a push uses the token typed here, never the server's own "
                                "login; type a token with write access")
            return text
        if kind == "upload":
            return self.upload(value)
        raise AssertionError(kind)

    def model(self, text: str, key: str, depth: int = 0) -> str:
        """A model or run folder inside the directory, not the UI's state folder; a Hub id (a path that is not there)
        only on loopback. A LoRA run's base (its adapter_config.json names it) is held to the same rule: every loader
        reads it."""
        from erniekit_lite.model.source import adapter_base

        path = confine(self.root, text, key)
        self._not_state(path, text, key)
        if self.exposed and not path.exists():
            raise UserError(f"{key}: {text} is not a folder inside {self.root}, and {EXPOSED}, where nothing is "
                            "downloaded from the Hub; download it into the folder first")
        base = adapter_base(str(path)) if path.is_dir() else None
        if base is not None and base != text and depth < 4:
            self.model(base, f"{key} (the base its adapter_config.json names)", depth + 1)
        return text

    def _not_state(self, path: Path, text: str, key: str) -> None:
        if path.is_relative_to((self.root / STATE_DIR).resolve()):
            raise UserError(f"{key}: {text} is in the web UI's own state folder ({STATE_DIR}), where it keeps what "
                            "visitors send; use a folder of your own")

    def environment(self, token: str | None = None) -> dict:
        """The environment of a process the UI starts for a visitor. On a UI others reach it lends no Hub identity of
        the server's and downloads nothing (HF_HUB_OFFLINE: what the Hugging Face cache holds only); a push gets the
        token typed for it and the network."""
        env = dict(os.environ)
        if self.exposed:
            for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
                env.pop(name, None)
            env.update(HF_TOKEN_PATH=str(self.root / STATE_DIR / "no-token"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        if token:
            env["HF_TOKEN"] = token
            env.pop("HF_HUB_OFFLINE", None)
            env.pop("HF_DATASETS_OFFLINE", None)
        return env

    def recipe(self, text: str, name: str) -> Checked:
        from erniekit_lite.webui import forms

        recipe = forms.parse(text, name)
        confine_recipe(self.root, recipe, self.exposed)
        self.model(recipe.model.path, "model.path")
        for entry in recipe.rewards or []:
            if entry.model is not None:
                self.model(entry.model, "rewards.model")
        self._not_state(confine(self.root, recipe.output.dir, "output.dir"), recipe.output.dir, "output.dir")
        for section in ("train", "eval"):
            for i, source in enumerate(getattr(recipe.data, section)):
                key = f"data.{section}.{i}.path"
                path = confine(self.root, source.path, key, readable=(shipped.RECIPES,))
                self._not_state(path, source.path, key)
                if self.exposed and not path.exists():
                    raise UserError(f"{key}: {source.path} is not a file inside {self.root}, and {EXPOSED}, where no Hub "
                                    "dataset is downloaded; put the data in the folder")
        if self.exposed:
            pushing = [f"train.{k}" for k, v in recipe.train.items() if v and (k.startswith("hub_") or k in PUSHING)]
            if recipe.hub is not None or pushing:
                key = "hub" if recipe.hub is not None else pushing[0]
                raise UserError(f"{key}: {EXPOSED}, where a run is not pushed with the server's Hub login; push it from "
                                "the Export tab with your own token")
            loggers = recipe.train.get("report_to")
            loggers = [loggers] if isinstance(loggers, str) else loggers or []
            if any(logger not in ("none", "tensorboard") for logger in loggers):
                raise UserError(f"train.report_to: {EXPOSED}, where a run reports to no account or server of the "
                                "server's user (tensorboard writes into the run folder)")
            for key in ("model_init_kwargs", "use_vllm", "vllm_server_base_url", "vllm_server_host"):
                if recipe.train.get(key):
                    raise UserError(f"train.{key}: {EXPOSED}, where a run loads no model and reaches no server but the "
                                    "ones erniekit-lite loads from the folder; train this recipe from the command line")
            if isinstance(recipe.train.get("deepspeed"), dict):
                raise UserError(f"train.deepspeed: {EXPOSED}, where DeepSpeed's settings come from a file in the folder "
                                "(a config's offload paths name the server's disks)")
        return Checked(text, name, recipe)

    def upload(self, value) -> Path:
        """A file in Gradio's upload folder (Gradio itself only hands over files it received or made)."""
        from gradio.utils import get_upload_folder

        path = Path(str(getattr(value, "path", value))).resolve()
        folder = Path(get_upload_folder()).resolve()
        if not path.is_relative_to(folder):
            raise UserError("upload: not a file this page uploaded; upload it again")
        return path

    def confine_images(self) -> None:
        """Images named inside data records are read only from inside the directory (or the shipped demo data):
        for Validate and Preview in this process, and for Start in the training process, which inherits it."""
        from erniekit_lite.data.vl import IMAGES_INSIDE

        os.environ[IMAGES_INSIDE] = os.pathsep.join([str(self.root.resolve()), str(shipped.RECIPES.resolve())])
