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
    from erniekit_lite.webui import app

    monkeypatch.setattr(app, "serve_until_interrupted", lambda demo: None)  # the CLI then waits for Ctrl-C; not here
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


# No code a visitor names: reward functions, reward models and trust_remote_code, through a served UI

EVIL = "from pathlib import Path\nPath({marker!r}).write_text('imported')\n\ndef reward(completions, **kw):\n    return [0.0] * len(completions)\n"


def grpo_text(reward: str, model: str = "tiny", **model_keys) -> str:
    extra = "".join(f"\n  {k}: {v}" for k, v in model_keys.items())
    return (f"model:\n  path: {model}{extra}\nmethod: grpo\ndata:\n  train: [recipes/data/grpo_arith.jsonl]\n"
            f"rewards:\n  - name: exact_answer\n  - {reward}\noutput:\n  dir: runs/g\n"
            "train:\n  num_generations: 4\n  max_completion_length: 8\n  per_device_train_batch_size: 8\n")


def pressed(client, text: str) -> tuple[str, str, str]:
    """What Validate, Preview and Start answer for `text`: each one's last (or only) line."""
    validated = client.predict(text, api_name="/validate")["value"].splitlines()[-1]
    _, previewed = client.predict(text, api_name="/show_preview")
    started = client.predict(text, api_name="/start")
    return validated, previewed, started


def test_a_served_ui_imports_no_reward_file_outside_its_folder_and_loads_no_remote_code(tmp_path, monkeypatch, tiny_own_dir):
    """A GRPO reward file outside the folder, or inside the UI's own state folder (where it keeps what visitors
    send), a reward model outside, and trust_remote_code are refused by Validate, Preview and Start alike, in one line
    and before anything is imported; a reward file of the user's own inside the folder runs as the CLI runs it."""
    import shutil

    from test_webui_forms import served_app

    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(tiny_own_dir, root / "tiny")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    markers = [elsewhere / "outside.txt", root / "state.txt", root / "mine.txt"]
    (elsewhere / "evil.py").write_text(EVIL.format(marker=str(markers[0])))
    (root / ".erniekit-webui").mkdir()
    (root / ".erniekit-webui" / "evil.py").write_text(EVIL.format(marker=str(markers[1])))
    (root / "mine.py").write_text(EVIL.format(marker=str(markers[2])))
    with served_app(root, monkeypatch) as client:
        outside = pressed(client, grpo_text(f"function: {elsewhere}/evil.py:reward"))
        state = pressed(client, grpo_text("function: .erniekit-webui/evil.py:reward"))
        model = pressed(client, grpo_text(f"model: {elsewhere}"))
        remote = pressed(client, grpo_text("name: think_format", trust_remote_code="true"))
        assert not any(m.exists() for m in markers)  # nothing was imported
        mine = client.predict(grpo_text("function: mine.py:reward"), api_name="/validate")["value"].splitlines()[-1]
    assert outside == (f"error: rewards.1.function: {elsewhere}/evil.py is outside {root}, the directory the web UI "
                       "was started in; use a path inside it",) * 3
    assert state == ("error: rewards.1.function: .erniekit-webui/evil.py is in the web UI's own state folder "
                     "(.erniekit-webui), where it keeps what visitors send; use a reward file of your own elsewhere "
                     "in the directory",) * 3
    assert model == (f"error: rewards.1.model: {elsewhere} is outside {root}, the directory the web UI was started "
                     "in; use a path inside it",) * 3
    assert remote == ("error: model.trust_remote_code: the web UI runs no code shipped with a checkpoint (ERNIE 4.5 "
                      "needs none); set it to false, or train this recipe from the command line",) * 3
    assert mine == "recipe.yaml: valid" and markers[2].read_text() == "imported"  # the user's own, inside: as the CLI
    assert not (root / "runs").exists()  # no job started


def test_a_ui_others_reach_runs_only_the_built_in_rewards(tmp_path, monkeypatch, tiny_own_dir):
    """Served for others (a non-loopback --host, --share or --auth): a reward file, even inside the folder, and an
    installed `package.module:function` are refused by Validate, Preview and Start; the built-ins by name run."""
    import shutil

    from test_webui_forms import served_app

    from erniekit_lite.webui.app import reachable_by_others

    assert [reachable_by_others(*a) for a in (("127.0.0.1", False, None), ("::1", False, None), ("localhost", False, None),
            ("0.0.0.0", False, None), ("my-host", False, None), ("127.0.0.1", True, None), ("127.0.0.1", False, ("u", "p")))
            ] == [False, False, False, True, True, True, True]
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(tiny_own_dir, root / "tiny")
    (root / "mine.py").write_text(EVIL.format(marker=str(root / "mine.txt")))
    (root / "evilpkg").mkdir()
    (root / "evilpkg" / "__init__.py").write_text(EVIL.format(marker=str(root / "pkg.txt")))
    monkeypatch.syspath_prepend(str(root))  # importable by name, as an installed package would be
    with served_app(root, monkeypatch, exposed=True) as client:
        answers = [pressed(client, grpo_text(reward)) for reward in ("function: mine.py:reward", "function: evilpkg:reward")]
        builtin = client.predict(grpo_text("name: think_format"), api_name="/validate")["value"].splitlines()[-1]
    refusal = ("error: rewards.1.function: this web UI is reachable by others (--host, --share or --auth), where only "
               "the built-in rewards run (name: exact_answer | think_format | length); train a recipe with your own "
               "reward from the command line")
    assert answers == [(refusal,) * 3] * 2
    assert not (root / "mine.txt").exists() and not (root / "pkg.txt").exists()
    assert builtin == "recipe.yaml: valid"


def test_ctrl_c_stops_the_web_ui_with_exit_130(tmp_path, monkeypatch, capsys):
    """As `train` and `serve` exit: Ctrl-C (a KeyboardInterrupt while serving) closes the server and exits 130 (Gradio's
    own wait caught it and the command exited 0)."""
    import time as real_time

    import gradio as gr

    from erniekit_lite.webui import app

    served = []
    real_launch = gr.Blocks.launch

    def launch_quietly(self, **kwargs):
        served.append(self)
        return real_launch(self, **{**kwargs, "quiet": True})

    def ctrl_c(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(gr.Blocks, "launch", launch_quietly)
    monkeypatch.setattr(app, "time", type("T", (), {"sleep": staticmethod(ctrl_c), "time": real_time.time}))
    monkeypatch.chdir(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["webui", "--port", str(port)]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted"
    assert not served[0].is_running  # closed
