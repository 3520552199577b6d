"""The web UI's one gate (erniekit_lite/webui/gate.py): every value a visitor sends names its kind and is confined
or refused before a handler runs. Driven through a served UI as a page drives it (gradio_client, raw HTTP), checking
that nothing ran (the Export tab's subprocesses are recorded instead of run, in the server's own process) and that
nothing outside the folder was read."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import gradio as gr
import pytest

from test_webui_forms import served_app

from erniekit_lite.webui import export_tab
from erniekit_lite.webui.gate import KINDS

# A component a visitor fills whose label says it names something: never taken as `plain`
PATH_LIKE = re.compile(r"\b(dir|path|folder|files?|model|run|repo|token|recipe|image|llama\.cpp|tasks|compare)\b", re.I)
VISITOR_TYPES = (gr.Textbox, gr.Dropdown, gr.Code, gr.File, gr.Image)
EXPOSED = "this web UI is reachable by others (--host, --share or --auth)"
PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                    "1f15c4890000000d49444154789c63f8cfc0f01f0005000201a5f6e2760000000049454e44ae426082")


def test_every_endpoint_names_the_kind_of_each_value_and_shows_no_server_path(tmp_path, monkeypatch):
    """Walks every registered event: each is the gate's, with a known kind for each input; a path-like field is never
    `plain`; only server-side state is taken as state. The page holds no llama.cpp field and not the server's folder."""
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path / "server-llama-secret"))
    monkeypatch.chdir(tmp_path)
    from erniekit_lite.webui import app

    demo = app.build(exposed=False)
    names = set()
    for fn in demo.fns.values():
        kinds = getattr(fn.fn, "gate_kinds", None)
        assert kinds is not None and len(kinds) == len(fn.inputs), fn.api_name  # registered through the gate
        names.add(fn.api_name)
        for kind, component in zip(kinds, fn.inputs):
            assert kind.rstrip("?") in KINDS, (fn.api_name, kind)
            assert (kind in ("state", "name")) == isinstance(component, gr.State), (fn.api_name, kind)
            if isinstance(component, VISITOR_TYPES) and PATH_LIKE.search(component.label or ""):
                assert kind != "plain", (fn.api_name, component.label)
        labels = [c.label or "" for c in fn.inputs]
        assert not any(re.search(r"\bllama", label, re.I) for label in labels), fn.api_name  # (Ollama is not it)
    assert {"validate", "choose", "show_preview", "start", "gguf", "push_run", "evaluate_run", "load"} <= names
    assert "server-llama-secret" not in json.dumps(demo.config, default=str)


@pytest.fixture
def recorded(monkeypatch):
    """The Export tab's subprocesses, recorded instead of run (command and environment); each answers exit 0."""
    calls = []

    def run(command, **kwargs):
        calls.append((command, kwargs.get("env")))
        return subprocess.CompletedProcess(command, 0, "export: recorded\n", "")

    monkeypatch.setattr(export_tab.subprocess, "run", run)
    return calls


def folder(tmp_path: Path) -> tuple[Path, Path]:
    """The served folder (with a run in it) and a folder beside it, outside."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "runs" / "a").mkdir(parents=True)
    (root / "runs" / "a" / "config.json").write_text("{}")
    (root / "eval_tasks").mkdir()
    outside.mkdir()
    return root, outside


def test_the_gguf_export_runs_only_the_servers_converter(tmp_path, monkeypatch, recorded):
    """Reproduced before: a page named any folder as llama.cpp's, and the server ran its convert_hf_to_gguf.py. Now
    the endpoint takes no such value (an extra one sent over raw HTTP is not used) and the export runs the converter
    the server was started with (`webui --llama-cpp`, relative to where it started), never $LLAMA_CPP_DIR's or a page's."""
    root, outside = folder(tmp_path)
    (outside / "convert_hf_to_gguf.py").write_text(f"open({str(outside / 'ran.txt')!r}, 'w').write('ran')\n")
    server_llama = tmp_path / "server-llama"
    server_llama.mkdir()
    monkeypatch.setenv("LLAMA_CPP_DIR", str(outside))  # the environment's is overridden by the command line's
    monkeypatch.chdir(tmp_path)
    with served_app(root, monkeypatch, llama_cpp="../server-llama") as client:
        parameters = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/gguf"]["parameters"]
        assert [p["label"] for p in parameters] == ["run dir", "GGUF output dir", "type", "also write an Ollama Modelfile"]
        assert client.predict("runs/a", "runs/a-gguf", "q8_0", True, api_name="/gguf") == "export: recorded"
        url = client.src.rstrip("/")
        request = urllib.request.Request(f"{url}/gradio_api/call/gguf", method="POST", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"data": ["runs/a", "runs/b-gguf", "q8_0", True, str(outside)]}).encode())
        try:
            event = json.loads(urllib.request.urlopen(request, timeout=30).read())["event_id"]
            urllib.request.urlopen(f"{url}/gradio_api/call/gguf/{event}", timeout=30).read()
        except urllib.error.HTTPError:
            pass  # refused outright: as good
        config = urllib.request.urlopen(f"{url}/config", timeout=30).read().decode()
    assert str(outside) not in config and "server-llama" not in config
    for command, env in recorded:
        assert command[3:] == ["export", command[4], "--to", "gguf", "--outtype", "q8_0", "--out", command[10], "--ollama",
                               "--llama-cpp", str(server_llama)]
        assert "LLAMA_CPP_DIR" not in env and str(outside) not in " ".join(command)
    assert len(recorded) in (1, 2) and recorded[0][0][4] == "runs/a"
    assert not (outside / "ran.txt").exists()


def test_every_value_is_confined_on_loopback(tmp_path, monkeypatch, recorded):
    """On 127.0.0.1: runs, outputs, task folders and models are confined to the folder, task names are names, and the
    loopback user's own Hub login pushes (private unless asked); each refusal one `error:` line, nothing run."""
    root, outside = folder(tmp_path)
    (root / ".erniekit-webui").mkdir()
    with served_app(root, monkeypatch) as client:
        said = [
            client.predict(str(outside), "merged", False, api_name="/merge_run"),
            client.predict("runs/a", ".erniekit-webui/merged", False, api_name="/merge_run"),
            client.predict("runs/a", "tiny_who", str(outside), None, False, "", api_name="/evaluate_run")[1],
            client.predict("runs/a", "../tasks.yaml", "", None, False, "", api_name="/evaluate_run")[1],
            client.predict("runs/a", "tiny_who", "", None, False, "../outside", api_name="/evaluate_run")[1],
            client.predict("../outside", "auto", 8000, api_name="/serve"),
            client.predict(str(outside), "", api_name="/load")[2],
            client.predict("runs/a", "someone/x", False, False, "", api_name="/push_run")[1],
            client.predict("runs/a", "tiny_who", "eval_tasks", 3, True, "", api_name="/evaluate_run")[1],
        ]
    outside_line = "is outside {}, the directory the web UI was started in; use a path inside it".format(root)
    assert said[:-2] == [
        f"error: model: {outside} {outside_line}",
        "error: .erniekit-webui/merged: the web UI's own state folder (.erniekit-webui); choose another folder",
        f"error: folder: {outside} {outside_line}",
        "error: tasks: '../tasks.yaml' is not an lm-eval task name (names only, comma-separated; local task YAMLs go in "
        "the task folder)",
        f"error: model: ../outside {outside_line}",
        f"error: model: ../outside {outside_line}",
        f"error: model: {outside} {outside_line}",
    ]
    assert said[-2:] == ["export: recorded"] * 2
    (push, push_env), (evaluate, _) = [(c[3:], env) for c, env in recorded]
    assert push == ["push", "runs/a", "--repo", "someone/x"]  # neither --public nor --private: a new repo is private
    assert push_env.get("HF_TOKEN") == __import__("os").environ.get("HF_TOKEN")  # the server's own login, on loopback
    assert evaluate == ["eval", "runs/a", "--tasks", "tiny_who", "--tasks-path", "eval_tasks", "--limit", "3", "--chat"]


def test_a_ui_others_reach_downloads_runs_and_pushes_nothing_of_the_servers(tmp_path, monkeypatch, recorded):
    """Exposed (a non-loopback --host, --share or --auth): a push needs a token typed in the request (never the
    server's login), no task folder is imported, no Hub model or dataset is fetched, a recipe pushes or reports to
    no account of the server's; a typed token pushes, private by default, and never comes back."""
    root, _ = folder(tmp_path)
    (root / "eval_tasks" / "t.yaml").write_text("task: t\n")
    (root / "runs" / "lora").mkdir()  # an adapter run whose base is a Hub id: every loader would fetch the base
    (root / "runs" / "lora" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "baidu/ERNIE-4.5-0.3B-PT"}))
    recipe = ("model:\n  path: {model}\ndata:\n  train: [{data}]\noutput:\n  dir: runs/b\n{extra}")
    local = dict(model="runs/a", data="recipes/data/identity.jsonl", extra="")
    from erniekit_lite import recipe as recipes

    monkeypatch.setattr(recipes, "_check_loggers", lambda value, where: None)  # stands in for wandb installed here
    with served_app(root, monkeypatch, exposed=True) as client:
        said = [
            client.predict("runs/a", "someone/x", False, False, "", api_name="/push_run")[1],
            client.predict("runs/a", "tiny_who", "eval_tasks", None, False, "", api_name="/evaluate_run")[1],
            client.predict("runs/a", "tiny_who", "", None, False, "baidu/ERNIE-4.5-0.3B-PT", api_name="/evaluate_run")[1],
            client.predict("baidu/ERNIE-4.5-0.3B-PT", "", api_name="/load")[2],
            client.predict("runs/lora", "", api_name="/load")[2],
            client.predict("-h", "merged", False, api_name="/merge_run"),
        ]
        validated = [client.predict(recipe.format(**{**local, **change}), api_name="/validate")["value"] for change in (
            {"model": "baidu/ERNIE-4.5-0.3B-PT"}, {"data": "someone/chats"}, {"extra": "hub:\n  repo_id: someone/x\n"},
            {"extra": "train:\n  push_to_hub: true\n"}, {"extra": "train:\n  report_to: wandb\n"},
            {"extra": "method: grpo\nrewards:\n  - name: length\ntrain:\n  log_completions_hub_repo: someone/completions\n"},
            {"extra": "method: grpo\nrewards:\n  - name: length\ntrain:\n  model_init_kwargs:\n    cache_dir: /tmp/elsewhere\n"},
            {"extra": "train:\n  chat_template_path: /etc/hostname\n"}, {"extra": "train:\n  hub_token: hf_x\n"},
            {"model": "runs/lora"}, {"extra": "output:\n  dir: .erniekit-webui/x\n"})]
        pushed = client.predict("runs/a", "someone/x", True, False, "hf_typed_secret", api_name="/push_run")
    assert said == [
        f"error: token: {EXPOSED}, where a push uses the token typed here, never the server's own login; type a token "
        "with write access",
        f"error: eval_tasks: {EXPOSED}, where no file of Python the server would import is taken (lm-eval task YAMLs "
        "can run `!function`s); run it from the command line",
        f"error: model: baidu/ERNIE-4.5-0.3B-PT is not a folder inside {root}, and {EXPOSED}, where nothing is "
        "downloaded from the Hub; download it into the folder first",
        f"error: model: baidu/ERNIE-4.5-0.3B-PT is not a folder inside {root}, and {EXPOSED}, where nothing is "
        "downloaded from the Hub; download it into the folder first",
        f"error: model (the base its adapter_config.json names): baidu/ERNIE-4.5-0.3B-PT is not a folder inside {root}, "
        f"and {EXPOSED}, where nothing is downloaded from the Hub; download it into the folder first",
        "error: -h: a path starting with '-'; write it as ./-h",
    ]
    assert validated[-2:] == [
        f"error: model.path (the base its adapter_config.json names): baidu/ERNIE-4.5-0.3B-PT is not a folder inside "
        f"{root}, and {EXPOSED}, where nothing is downloaded from the Hub; download it into the folder first",
        "error: output.dir: .erniekit-webui/x is in the web UI's own state folder (.erniekit-webui), where it keeps what "
        "visitors send; use a folder of your own"]
    assert validated[-6:-2] == [
        f"error: train.log_completions_hub_repo: {EXPOSED}, where a run is not pushed with the server's Hub login; push "
        "it from the Export tab with your own token",
        f"error: train.model_init_kwargs: {EXPOSED}, where a run loads no model and reaches no server but the ones "
        "erniekit-lite loads from the folder; train this recipe from the command line",
        "error: recipe.yaml:8: train.chat_template_path is TRL's, for its own data preparation or model loading; "
        "erniekit-lite does that itself for sft (use the data's template)",
        "error: train.hub_token: a token in a recipe is shown to every page of the web UI (the running job's recipe); "
        "remove it, and push from the Export tab with a token typed there"]
    validated = validated[:-6]
    assert validated == [
        f"error: model.path: baidu/ERNIE-4.5-0.3B-PT is not a folder inside {root}, and {EXPOSED}, where nothing is "
        "downloaded from the Hub; download it into the folder first",
        f"error: data.train.0.path: someone/chats is not a file inside {root}, and {EXPOSED}, where no Hub dataset is "
        "downloaded; put the data in the folder",
        f"error: hub: {EXPOSED}, where a run is not pushed with the server's Hub login; push it from the Export tab with "
        "your own token",
        f"error: train.push_to_hub: {EXPOSED}, where a run is not pushed with the server's Hub login; push it from the "
        "Export tab with your own token",
        f"error: train.report_to: {EXPOSED}, where a run reports to no account or server of the server's user (tensorboard "
        "writes into the run folder)",
    ]
    assert pushed == ("", "export: recorded")  # the token box cleared
    [(command, env)] = recorded
    assert command[3:] == ["push", "runs/a", "--repo", "someone/x", "--public"] and env["HF_TOKEN"] == "hf_typed_secret"
    # what the UI starts for a visitor (a job, an export, an evaluation) gets no login of the server's and no network
    from erniekit_lite.webui.gate import Gate

    monkeypatch.setenv("HF_TOKEN", "hf_servers_own")
    lent = Gate(root, exposed=True).environment()
    assert "HF_TOKEN" not in lent and lent["HF_HUB_OFFLINE"] == "1" and not Path(lent["HF_TOKEN_PATH"]).exists()
    assert Gate(root, exposed=False).environment()["HF_TOKEN"] == "hf_servers_own"  # loopback: the user's own


def test_images_named_in_records_stay_inside_the_folder(tmp_path, monkeypatch, tiny_vl_dir):
    """Reproduced before: a record naming an image outside the folder passed Validate (and the errors told a visitor
    which outside paths exist). Now an image outside (absolute, `..`, `~`) is refused without being opened, the same
    line whether or not it exists; the shipped colours, inside, validate."""
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(tiny_vl_dir, root / "tiny-vl")
    (tmp_path / "secret.png").write_bytes(PNG)
    refs = [str(tmp_path / "secret.png"), "../nothing-here.png", "~/x.png"]
    for i, ref in enumerate(refs):
        record = {"messages": [{"role": "user", "content": "<image>What colour?"}, {"role": "assistant", "content": "Red."}],
                  "images": [ref]}
        (root / f"d{i}.jsonl").write_text(json.dumps(record) + "\n")
    text = "model:\n  path: tiny-vl\ndata:\n  train: [{data}]\n  max_length: 256\noutput:\n  dir: runs/v\n"
    with served_app(root, monkeypatch) as client:
        last = [client.predict(text.format(data=f"d{i}.jsonl"), api_name="/validate")["value"].splitlines()[-1]
                for i in range(len(refs))]
        inside = client.predict(text.format(data="recipes/data/colours.jsonl"), api_name="/validate")["value"]
    assert last == [f"error: d{i}.jsonl:1: image {ref}: outside the folder this web UI serves; put the images beside "
                    "the data in it" for i, ref in enumerate(refs)]
    assert inside.splitlines()[-1] == "recipe.yaml: valid"
