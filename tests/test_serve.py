"""`erniekit-lite serve` with the transformers engine (`transformers serve`), queried with the official `openai`
client: single-turn answers, plain and streamed, equal `chat`'s greedy answer and end at the stop tokens; a LoRA
run is merged once, beside it, and served as merged; `/v1/models` lists the served name with no Hugging Face
cache, and Ctrl-C stops the server with 130 and no traceback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import TEST_EXTRA, needs, optional

from erniekit_lite.chat import load
from erniekit_lite.generate import answer
from erniekit_lite.serve import serve_command, servable
from helpers import IDENTITY, identity_run, run_cli, write_recipe

openai = optional("openai")
pytestmark = needs(openai is not None, "the openai client", TEST_EXTRA)
ANSWERS = {json.loads(line)["src"][0]: json.loads(line)["tgt"][0] for line in IDENTITY.read_text().splitlines()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_own_dir) -> Path:
    return identity_run(tmp_path_factory.mktemp("serve-full"), tiny_own_dir)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_own_dir) -> Path:
    from erniekit_lite.cli import main

    tmp = tmp_path_factory.mktemp("serve-lora")
    recipe = write_recipe(tmp / "r.yaml", tiny_own_dir, lora={"r": 8, "alpha": 16}, out=tmp / "run",
                          train={"learning_rate": 2e-2, "max_steps": 20, "per_device_train_batch_size": 1, "activation_checkpointing": False,
                                 "save_steps": 100, "seed": 0})
    assert main(["train", str(recipe)]) == 0
    return tmp / "run"


def wait_until_up(process: subprocess.Popen, port: int, log: Path, seconds: float, stop) -> None:
    """Until the server answers /health; if it exits or takes longer, `stop()` it and fail with its log's tail."""
    deadline = time.time() + seconds
    while True:
        if process.poll() is not None or time.time() > deadline:
            stop()
            raise AssertionError(log.read_text()[-4000:])
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(0.5)


class Server:
    """`erniekit-lite serve RUN --engine transformers` on a free port, until the test is done. Its HF_HOME is an
    empty folder, as on a machine that never downloaded a model (`transformers serve` lists models from there)."""

    def __init__(self, run: Path, log: Path):
        self.port = free_port()
        self.log = open(log, "w")
        (log.parent / "hf-home").mkdir()
        env = {k: v for k, v in os.environ.items() if k != "HF_HUB_CACHE"}
        self.process = subprocess.Popen([sys.executable, "-m", "erniekit_lite", "serve", str(run), "--engine", "transformers",
                                         "--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**env, "HF_HOME": str(log.parent / "hf-home"), "PYTHONPATH": os.pathsep.join(sys.path)})
        wait_until_up(self.process, self.port, log, 180, self.close)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="not-needed")

    def close(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def greedy(path: Path, prompt: str, tokens: int) -> str:
    model, tokenizer = load(str(path))
    return answer(model, tokenizer, prompt, max_new_tokens=tokens)


@pytest.mark.slow
def test_answers_equal_chat_and_stop_at_the_stop_tokens(tmp_path, full_run):
    server = Server(full_run, tmp_path / "server.log")
    try:
        # the served run by the name the log gives, though there is no Hugging Face cache (transformers' own list: 500)
        assert [m.id for m in server.client.models.list()] == [str(full_run)]
        for prompt in ("Who are you?", "What is your name?", "你是谁？"):
            messages = [{"role": "user", "content": prompt}]
            reply = server.client.chat.completions.create(model=str(full_run), messages=messages, temperature=0, max_tokens=48)
            expected = greedy(full_run, prompt, 48)
            assert reply.choices[0].message.content == expected
            assert reply.model == str(full_run)  # the name /v1/models gives (transformers' own adds "@main")
            assert reply.choices[0].finish_reason == "stop"  # ended by </s> or <|end_of_sentence|>, not the token limit
            assert "<|end_of_sentence|>" not in expected and "</s>" not in expected
            stream = list(server.client.chat.completions.create(model=str(full_run), messages=messages, temperature=0, max_tokens=48, stream=True))
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
            assert {c.model for c in stream} == {str(full_run)}
        assert greedy(full_run, "Who are you?", 48) == ANSWERS["Who are you?"]  # the run learned; the server says it
    finally:
        server.close()
    log = (tmp_path / "server.log").read_text()
    assert f"serve: http://127.0.0.1:{server.port}/v1" in log
    # Ctrl-C (close() sends SIGINT): a clean stop, not transformers' CLI's "Aborted!" and exit 1
    assert server.process.returncode == 130 and "Aborted!" not in log and "Traceback" not in log


@pytest.mark.slow
def test_a_lora_run_is_merged_once_and_served_merged(tmp_path, capsys, lora_run):
    said = []
    merged = Path(servable(str(lora_run), log=said.append))
    assert merged == lora_run.with_name("run.merged") and (merged / "config.json").is_file()
    assert any("merging the LoRA run" in line for line in said)
    stamp = (merged / "erniekit_merged.json").stat().st_mtime
    said.clear()
    assert servable(str(lora_run), log=said.append) == str(merged)
    assert said == [f"serve: reusing {merged}, the merge of {lora_run}"]
    assert (merged / "erniekit_merged.json").stat().st_mtime == stamp

    server = Server(lora_run, tmp_path / "server.log")
    try:
        assert [m.id for m in server.client.models.list()] == [str(merged)]
        reply = server.client.chat.completions.create(model=str(merged), messages=[{"role": "user", "content": "Who made you?"}],
                                                      temperature=0, max_tokens=16)
        assert reply.choices[0].message.content == greedy(lora_run, "Who made you?", 16)  # base + adapter, unmerged
    finally:
        server.close()
    assert f"requests name the model {str(merged)!r}" in (tmp_path / "server.log").read_text()  # as the request above did


def test_commands_and_bad_input(tmp_path, capsys, tiny_own_dir):
    command, model = serve_command(str(tiny_own_dir), "auto", "127.0.0.1", 8000, None)
    assert model == str(tiny_own_dir)
    if command[0] == sys.executable:  # no vllm on PATH here: auto is transformers, bound to localhost
        assert command[-6:] == ["serve", str(tiny_own_dir), "--host", "127.0.0.1", "--port", "8000"]
    fake = tmp_path / "venv" / "bin" / "vllm"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\n")  # not a Python console script: run as `vllm serve`
    fake.chmod(0o755)
    assert serve_command(str(tiny_own_dir), "auto", "127.0.0.1", 9000, str(tmp_path / "venv"))[0] == [
        str(fake), "serve", str(tiny_own_dir), "--host", "127.0.0.1", "--port", "9000"]
    fake.write_text(f"#!{sys.executable}\nimport sys\n")  # pip's console script: vLLM's server module in that Python
    assert serve_command(str(tiny_own_dir), "vllm", "127.0.0.1", 9000, str(fake))[0] == [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_own_dir), "--host", "127.0.0.1", "--port", "9000"]
    thinking = tmp_path / "thinking"
    thinking.mkdir()
    (thinking / "config.json").write_text("{}")
    from test_tool_calls import THINKING_TEMPLATE  # the released Thinking template, from ../shared

    (thinking / "chat_template.jinja").write_text(THINKING_TEMPLATE or "{{ '<think>\\n' }}")  # a stand-in without ../shared
    assert serve_command(str(thinking), "vllm", "127.0.0.1", 8000, str(fake))[0][-5:] == [
        "--tool-call-parser", "ernie45", "--enable-auto-tool-choice", "--reasoning-parser", "ernie45"]

    def error(*argv) -> str:
        code, out, err = run_cli(capsys, "serve", *argv)
        assert code == 2 and err.count("\n") == 1, err
        return err

    assert "no such directory" in error(tmp_path / "nothing")
    assert "not a finished run or a model dir" in error(tmp_path)
    assert "--vllm" in error(tiny_own_dir, "--vllm", tmp_path / "none")
    if serve_command(str(tiny_own_dir), "auto", "127.0.0.1", 8000, None)[0][0] == sys.executable:
        assert "no `vllm` executable on PATH" in error(tiny_own_dir, "--engine", "vllm")


def test_transformers_serve_without_its_packages_is_one_line(tiny_own_dir, monkeypatch):
    """`transformers serve` imports transformers[serving]'s packages inside its own CLI, where a missing one is a
    traceback: `serve` names them first (stand-in: find_spec reports openai and uvicorn absent)."""
    import importlib.util

    from erniekit_lite.errors import UserError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("openai", "uvicorn") else real(name, *a))
    with pytest.raises(UserError, match=r"^--engine transformers: `transformers serve` needs openai, uvicorn: "
                                        r"pip install 'transformers\[serving\]'"):
        serve_command(str(tiny_own_dir), "transformers", "127.0.0.1", 8000, None)
