"""Web UI safety: paths stay inside the directory it was started in (`..`, absolute paths and symlinks pointing
out are refused with one line; recipes are checked on every path they read or write); it binds 127.0.0.1 without a
share link unless asked; --auth or ERNIEKIT_WEBUI_AUTH puts a login in front of the whole app."""

from __future__ import annotations

import socket
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from erniekit_lite import recipe as recipes
from erniekit_lite import shipped
from erniekit_lite.cli import main
from erniekit_lite.errors import UserError
from erniekit_lite.webui import forms
from erniekit_lite.webui.app import parse_auth
from erniekit_lite.webui.paths import confine, confine_recipe, model_dirs, open_recipe, recipe_choices, recipe_files


@pytest.fixture
def root(tmp_path) -> Path:
    (tmp_path / "root" / "runs" / "a").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "root" / "escape").symlink_to(tmp_path / "outside")
    (tmp_path / "root" / "inner").symlink_to(tmp_path / "root" / "runs")
    return tmp_path / "root"


def test_paths_inside_pass(root):
    assert confine(root, "runs/a", "model") == root / "runs" / "a"
    assert confine(root, str(root / "runs" / "new"), "output.dir") == root / "runs" / "new"
    assert confine(root, "inner/a", "model") == root / "runs" / "a"  # a link that stays inside is fine
    assert confine(root, "baidu/ERNIE-4.5-0.3B-PT", "model").is_relative_to(root)  # Hub ids load from the Hub


@pytest.mark.parametrize("text", ["../outside", "/etc/passwd", "runs/../../outside", "escape", "escape/new-run", "~"])
def test_paths_outside_are_refused(root, text):
    with pytest.raises(UserError) as e:
        confine(root, text, "output.dir")
    assert str(e.value) == (f"output.dir: {text} is outside {root}, the directory the web UI was started in; "
                            "use a path inside it")


def test_empty_path_is_refused(root):
    with pytest.raises(UserError, match="^model: empty; enter a path inside"):
        confine(root, "  ", "model")


def recipe(**changes) -> recipes.Recipe:
    raw = {"model": {"path": "runs/a"}, "data": {"train": ["d.jsonl"], "eval": ["e.jsonl"]}, "output": {"dir": "runs/b"}}
    for key, value in changes.items():
        section, name = key.split("__")
        raw.setdefault(section, {})[name] = value
    return recipes.from_dict(raw)


@pytest.mark.parametrize("key, shown", [
    ("model__path", "model.path"),
    ("output__dir", "output.dir"),
    ("data__eval", "data.eval.0.path"),
    ("train__resume_from_checkpoint", "train.resume_from_checkpoint"),
])
def test_recipes_are_confined_on_every_path(root, key, shown):
    confine_recipe(root, recipe())
    with pytest.raises(UserError, match=f"^{shown}: escape/x is outside"):
        confine_recipe(root, recipe(**{key: ["escape/x"] if key == "data__eval" else "escape/x"}))


def test_listings(root, tmp_path):
    for name in ("recipes/quickstart.yaml", "recipes/m/sft.yaml", "recipes/accelerate/fsdp2.yaml"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("{}")
    assert recipe_files(root) == ["recipes/m/sft.yaml", "recipes/quickstart.yaml"]
    for name in ("runs/a/adapter_config.json", "runs/a/checkpoint-5/adapter_config.json", "tiny/config.json",
                 ".erniekit-webui/x/config.json"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("{}")
    (tmp_path / "outside" / "config.json").write_text("{}")
    assert "runs/a" in model_dirs(root) and "tiny" in model_dirs(root)
    assert not any("checkpoint" in d or d.startswith(".") for d in model_dirs(root))


def test_the_recipe_list_outside_a_clone_is_the_shipped_recipes(root):
    """Started where there is no recipes/ (a wheel install), the list is what `erniekit-lite recipes` lists, and a
    shipped recipe opens with its demo data pointed into the package: read there (only read), as `train NAME` does."""
    assert recipe_choices(root) == sorted(f"recipes/{name}.yaml" for name in shipped.names())
    name, text, package = open_recipe(root, "recipes/quickstart.yaml")
    recipe = forms.parse(text, name)
    assert (name, package) == ("quickstart.yaml", True)
    assert recipe.data.train[0].path == str(shipped.RECIPES / "data" / "identity.jsonl")
    comments = [line for line in (shipped.RECIPES / "quickstart.yaml").read_text().splitlines() if line.startswith("#")]
    assert [line for line in text.splitlines() if line.startswith("#")] == comments  # the comments stay
    confine_recipe(root, recipe)
    into_package = recipe.model_copy(update={"output": recipe.output.model_copy(update={"dir": str(shipped.RECIPES / "x")})})
    with pytest.raises(UserError, match="^output.dir: .* is outside"):
        confine_recipe(root, into_package)
    with pytest.raises(UserError, match="^recipe: recipes/nope.yaml is neither a file"):
        open_recipe(root, "recipes/nope.yaml")
    # a file of the user's own under that name is the one opened, as `erniekit-lite train recipes/quickstart.yaml` reads it
    (root / "recipes").mkdir()
    (root / "recipes" / "quickstart.yaml").write_text("# mine\n")
    (root / "recipes" / "mine.yaml").write_text("# mine too\n")
    assert open_recipe(root, "recipes/quickstart.yaml") == ("quickstart.yaml", "# mine\n", False)
    assert recipe_choices(root).count("recipes/quickstart.yaml") == 1 and "recipes/mine.yaml" in recipe_choices(root)
    (root / "recipes" / "out.yaml").symlink_to(root.parent / "outside")
    with pytest.raises(UserError, match="^recipe: recipes/out.yaml is outside"):
        open_recipe(root, "recipes/out.yaml")


def test_auth():
    assert parse_auth("me:secret:with:colons") == ("me", "secret:with:colons")
    assert parse_auth(None) is None and parse_auth("") is None
    for bad in ("nocolon", ":pw", "me:"):
        with pytest.raises(UserError, match="expected USER:PASSWORD"):
            parse_auth(bad)


def test_cli_serves_localhost_behind_the_login_from_the_environment(tmp_path, monkeypatch, capsys):
    import gradio as gr

    launched = []
    real_launch = gr.Blocks.launch

    def launch_in_background(self, **kwargs):  # returns once serving, as the CLI's own launch does
        launched.append((self, kwargs))
        return real_launch(self, **{**kwargs, "prevent_thread_lock": True, "quiet": True})

    monkeypatch.setattr(gr.Blocks, "launch", launch_in_background)
    monkeypatch.setattr(gr.Blocks, "block_thread", lambda self: None)  # the CLI then waits for Ctrl-C; not here
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ERNIEKIT_WEBUI_AUTH", "me:pw")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["webui", "--port", str(port)]) == 0
    assert capsys.readouterr().out == f"erniekit-lite webui: http://127.0.0.1:{port}/ (a public link: --share); Ctrl-C stops it\n"
    demo, kwargs = launched[0]
    try:
        assert (kwargs["server_name"], kwargs["share"], kwargs["auth"]) == ("127.0.0.1", False, ("me", "pw"))
        url = f"http://127.0.0.1:{port}"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}/config")
        assert refused.value.code == 401
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
        opener.open(f"{url}/login", data=urllib.parse.urlencode({"username": "me", "password": "pw"}).encode())
        assert opener.open(f"{url}/config").status == 200
    finally:
        demo.close()

    assert main(["webui", "--auth", "no-colon"]) == 2
    assert capsys.readouterr().err.strip() == "error: --auth / ERNIEKIT_WEBUI_AUTH: expected USER:PASSWORD"
