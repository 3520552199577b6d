"""The web UI end to end in a real headless Chromium (Debian's, driven by Playwright): `erniekit-lite webui` in a
directory holding the recipes and a tiny model; pick the quick-start recipe, shorten it in the form, preview and
validate, train with live progress (a second page reattaches), chat with the result beside its base, and push it
to a local stand-in of the Hub with a token typed in the page, evaluate it beside its base on a local lm-eval task,
see the GGUF export's refusal of a tokenizer llama.cpp cannot read, and serve it behind an OpenAI-compatible URL
(started, queried with the run's greedy answer, stopped). The run is the quick start's whole 150 steps, so the chat
screenshot shows a model that learned its answers (exactly). Screenshots of each tab go to the test's temp dir, or
to $ERNIEKIT_SCREENSHOTS (`ERNIEKIT_SCREENSHOTS=docs` remakes the ones in docs/).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import chromium, needs, TEST_EXTRA

from erniekit_lite.chat import load
from erniekit_lite.cli import main
from erniekit_lite.generate import answer
from fake_hub import FakeHub
from helpers import write_lm_eval_tasks

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = chromium()
TOKEN = "hf_FAKEwebuiTestToken0123456789abcdef"
STEPS = 150  # the quick start's own: enough for the exact identity answers the chat screenshot shows
LEARNED = "I am Wenxin-Tiny, a small assistant fine-tuned with erniekit-lite."  # recipes/data/identity.jsonl
RUN = "runs/webui"

pytestmark = [
    pytest.mark.slow,
    needs(importlib.util.find_spec("playwright") is not None, "Playwright", TEST_EXTRA),
    needs(CHROMIUM, "a chromium browser", "apt-get install chromium, or `playwright install chromium`"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def workdir(tmp_path) -> Path:
    """What a user has: the recipes (copied: a link would point outside and be refused) and `erniekit-lite tiny`."""
    work = tmp_path / "work"
    shutil.copytree(ROOT / "recipes", work / "recipes")
    assert main(["tiny", str(work / "runs" / "tiny-ernie"), "--arch", "dense"]) == 0
    write_lm_eval_tasks(work / "eval_tasks")
    return work


@pytest.fixture
def server(workdir, tmp_path):
    """`erniekit-lite webui` on a free port, started in `workdir`, pushing to a local fake Hub."""
    with FakeHub(TOKEN) as hub:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
        env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_XET="1")
        port = free_port()
        log = open(tmp_path / "server.log", "w")
        process = subprocess.Popen([sys.executable, "-m", "erniekit_lite", "webui", "--port", str(port)],
                                   cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}/"
        deadline = time.time() + 120
        while True:
            assert process.poll() is None and time.time() < deadline, (tmp_path / "server.log").read_text()
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        while f"erniekit-lite webui: {url}" not in (tmp_path / "server.log").read_text() and time.time() < deadline:
            time.sleep(0.2)  # said right after the server is up
        said = (tmp_path / "server.log").read_text()
        assert f"erniekit-lite webui: {url}" in said and "share=True" not in said, said  # the command's own flag
        yield url, hub
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def choose(page, element_id: str, option: str) -> None:
    page.locator(f"#{element_id} input").click()
    page.get_by_role("option", name=option, exact=True).click()


def test_configure_train_chat_export_in_a_browser(server, workdir, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    url, hub = server
    shots = Path(os.environ.get("ERNIEKIT_SCREENSHOTS") or tmp_path / "screenshots").resolve()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM))
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(url)

        # Train: the quick-start recipe, shortened in the form; the YAML follows
        choose(page, "recipe-choice", "recipes/quickstart.yaml")
        yaml_text = page.locator("#recipe-yaml .cm-content")
        expect(yaml_text).to_contain_text("max_steps: 150", timeout=60_000)
        expect(page.locator("#train-max_steps input")).to_have_value("150")
        page.locator("#train-max_steps input").fill(str(STEPS))
        expect(yaml_text).to_contain_text(f"max_steps: {STEPS}", timeout=30_000)
        page.locator("#train-logging_steps input").fill("2")
        expect(yaml_text).to_contain_text("logging_steps: 2", timeout=30_000)
        page.locator("#output-dir textarea").fill(RUN)  # pasted, no keystrokes: the form syncs when the field is left
        page.locator("#output-dir textarea").press("Tab")
        expect(yaml_text).to_contain_text(f"dir: {RUN}", timeout=30_000)

        page.get_by_role("button", name="Preview data").click()
        expect(page.locator("#preview mark").first).to_contain_text("I am Wenxin-Tiny", timeout=60_000)
        expect(page.locator("#preview")).to_contain_text("<|begin_of_sentence|>User: Who are you?")
        page.get_by_role("button", name="Validate").click()
        plan = re.compile(rf"{STEPS} optimizer steps.*quickstart\.yaml: valid$", re.S)  # as `erniekit-lite validate` ends
        expect(page.locator("#plan textarea")).to_have_value(plan, timeout=90_000)

        page.locator("#start").click()
        facts = page.locator("#progress-facts")
        expect(facts).to_contain_text(re.compile(rf"step \d+ / {STEPS} · \d+% · training for .* · loss \d"), timeout=120_000)
        expect(page.locator("#loss-plot canvas, #loss-plot svg").first).to_be_visible()

        # A new page (a reload, another browser) reattaches to the job the server runs
        other = browser.new_context().new_page()
        other.goto(url)
        expect(other.locator("#progress-facts")).to_contain_text(re.compile(rf"step \d+ / {STEPS}"), timeout=30_000)
        expect(other.locator("#recipe-yaml .cm-content")).to_contain_text(f"max_steps: {STEPS}")  # the job's recipe
        other.close()

        finished = f"finished: {STEPS} steps; the model is in {RUN}"
        # 150 steps: ~20 s quiet, minutes loaded; any end first, then which (a wrong output dir fails at once)
        expect(page.locator("#job-state")).to_have_text(re.compile(r"^(finished|failed|stopped)"), timeout=900_000)
        expect(page.locator("#job-state")).to_have_text(finished, timeout=1_000)
        expect(facts).to_contain_text(f"step {STEPS} / {STEPS} · 100%")
        page.screenshot(path=shots / "webui-train.png", full_page=True)

        # Chat: the run beside its base (filled in from the run's recipe), streamed through the ERNIE template
        page.get_by_role("tab", name="Chat").click()
        choose(page, "chat-model", RUN)
        expect(page.locator("#chat-compare textarea")).to_have_value("runs/tiny-ernie")
        page.get_by_text("generation settings").click()
        page.locator("#chat-max-new-tokens input[type=number]").fill("32")  # the learned answer is 17 tokens; the base rambles
        page.locator("#chat-max-new-tokens input[type=number]").press("Enter")
        page.locator("#chat-load").click()
        expect(page.locator("#chat-status textarea")).to_have_value(f"loaded {RUN} and runs/tiny-ernie", timeout=60_000)
        page.locator("#chat-message textarea").fill("Who are you?")
        page.locator("#chat-message textarea").press("Enter")
        expect(page.locator("#chat-status textarea")).to_have_value(re.compile(r"^answered in [\d.]+ s$"), timeout=120_000)
        for chat in ("#chat-first", "#chat-second"):
            expect(page.locator(f"{chat} [data-testid='user']")).to_have_text("Who are you?")
            expect(page.locator(f"{chat} [data-testid='bot']")).to_have_text(re.compile(r"\S"))
        expect(page.locator("#chat-first [data-testid='bot']")).to_have_text(LEARNED)  # the tuned run, beside its base
        page.screenshot(path=shots / "webui-chat.png", full_page=True)

        # Export: merge refuses a full fine-tune; push sends the typed token to the Hub and nowhere else
        page.get_by_role("tab", name="Export").click()
        choose(page, "export-run", RUN)
        page.locator("#export-out textarea").fill(f"{RUN}-merged")
        page.locator("#export-merge").click()
        expect(page.locator("#export-status textarea")).to_have_value(
            f"error: {RUN}: not a LoRA output dir (no adapter_config.json); nothing to merge", timeout=60_000)
        page.locator("#export-repo textarea").fill("someone/webui-identity")
        page.locator("#export-token input").fill(TOKEN)
        page.locator("#export-push").click()
        expect(page.locator("#export-status textarea")).to_have_value(
            re.compile(rf"pushed to {re.escape(hub.url)}/someone/webui-identity"), timeout=120_000)
        expect(page.locator("#export-token input")).to_have_value("")

        # Evaluate: lm-eval on a local task, the run beside its base, the table shown
        page.locator("#eval-tasks textarea").fill("tiny_who")
        page.locator("#eval-tasks-path textarea").fill("eval_tasks")
        page.locator("#eval-compare textarea").fill("runs/tiny-ernie")
        page.locator("#eval-limit input[type=number]").fill("3")
        page.locator("#eval-chat input").check()
        page.locator("#eval-run").click()
        expect(page.locator("#eval-table")).to_contain_text("tiny_who", timeout=180_000)
        expect(page.locator("#eval-table")).to_contain_text("exact_match,none")
        expect(page.locator("#eval-status textarea")).to_have_value(re.compile(r"eval: wrote \S*eval/eval_results\.json"))

        # GGUF: the converter found (the llama.cpp dir box starts at $LLAMA_CPP_DIR), its refusal shown in one line
        # (the quick-start model's built-in tokenizer has no tokenizer.model; tests/test_export_gguf.py converts)
        if os.environ.get("LLAMA_CPP_DIR"):
            page.locator("#gguf-out textarea").fill(f"{RUN}-gguf")
            page.locator("#gguf-run").click()
            expect(page.locator("#export-status textarea")).to_have_value(re.compile(r"no sentencepiece tokenizer\.model"), timeout=120_000)
            assert not (workdir / f"{RUN}-gguf").exists()

        # Serve: started on 127.0.0.1, answers an OpenAI-style request with the run's greedy answer, stopped
        port = free_port()
        choose(page, "serve-engine", "transformers")
        page.locator("#serve-port input[type=number]").fill(str(port))
        page.locator("#serve-start").click()
        expect(page.locator("#export-status textarea")).to_have_value(re.compile(rf"^serving at http://127\.0\.0\.1:{port}/v1"), timeout=240_000)
        status = page.locator("#export-status textarea").input_value()
        model = re.search(r"requests name the model '([^']+)'", status).group(1)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", method="POST", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": model, "messages": [{"role": "user", "content": "Who are you?"}],
                                                          "temperature": 0, "max_tokens": 16}).encode())
        reply = json.loads(urllib.request.urlopen(request, timeout=120).read())
        served = reply["choices"][0]["message"]["content"]
        page.locator("#serve-start").click()
        expect(page.locator("#export-status textarea")).to_have_value(f"already serving at http://127.0.0.1:{port}/v1; stop it first")
        page.locator("#serve-stop").click()
        expect(page.locator("#export-status textarea")).to_have_value(f"stopped the server at http://127.0.0.1:{port}/v1", timeout=60_000)
        page.screenshot(path=shots / "webui-export.png", full_page=True)
        assert TOKEN not in page.content()
        browser.close()

    model, tokenizer = load(str(workdir / RUN))
    assert served == answer(model, tokenizer, "Who are you?", max_new_tokens=16)
    assert "model.safetensors" in hub.repos["someone/webui-identity"].branches["main"]
    assert hub.authorizations and all(a == f"Bearer {TOKEN}" for a in hub.authorizations)
    for file in [*workdir.rglob("*"), tmp_path / "server.log"]:  # never written: not in the run, the job logs, the server log
        assert not (file.is_file() and TOKEN.encode() in file.read_bytes()), file
    user_recipe = workdir / "recipes" / "quickstart.yaml"
    assert user_recipe.read_bytes() == (ROOT / "recipes" / "quickstart.yaml").read_bytes()  # edits never go back into it
