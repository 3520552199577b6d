"""Export tab: merge a LoRA run into a full model, push a run to the Hugging Face Hub, export a GGUF (and an Ollama
Modelfile) through llama.cpp, serve a run behind an OpenAI-compatible URL, and evaluate a run on lm-eval
benchmarks against its base (`erniekit-lite eval --tasks ... --compare`). Each runs the CLI command in a subprocess,
on values the gate (gate.py) admitted: every function here takes them as admitted.

One server at a time, owned by this web UI process (any page sees it): `erniekit-lite serve` on 127.0.0.1, in a
process group of its own, stopped by Stop or when the web UI exits.

llama.cpp's converter is the one the server was started with (`webui --llama-cpp DIR` or `$LLAMA_CPP_DIR`): a page
neither names nor sees it (it would run that folder's Python as the server's user).

A token typed here lives only in this request: it goes into the environment of the `erniekit-lite push`
subprocess (setting it in the server's own environment would hand it to every later job and page), is never
written, logged or shown, and the password box is cleared after the push. Blank, on loopback the push uses the
server's own login (HF_TOKEN or `hf auth login`); a UI others reach refuses it (gate.py, `token`).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import gradio as gr

from erniekit_lite.errors import UserError
from erniekit_lite.webui.gate import Gate
from erniekit_lite.webui.paths import STATE_DIR, model_dirs


def merge(root: Path, run: str, out: str, overwrite: bool) -> str:
    from erniekit_lite.model.merge import merge as merge_run

    try:
        said: list[str] = []
        merged = merge_run(run, out, overwrite, log=said.append)
    except UserError as e:
        return f"error: {e}"
    return "\n".join([f"merged {run} into {merged}: loads with AutoModelForCausalLM.from_pretrained({str(merged)!r})", *said])


def evaluate(root: Path, run: str, tasks: str, tasks_path: str, limit: float | None, chat: bool, compare: str,
             env: dict) -> tuple[str, str]:
    """`erniekit-lite eval RUN --tasks ... [--compare BASE]` in a subprocess (the model's memory is freed with it):
    the table it prints (Markdown) and the rest of its output."""
    command = [sys.executable, "-m", "erniekit_lite", "eval", run, "--tasks", tasks]
    command += ["--tasks-path", tasks_path] * bool(tasks_path) + ["--compare", compare] * bool(compare)
    command += ["--limit", f"{limit:g}"] * bool(limit) + ["--chat"] * chat
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    table = "\n".join(line for line in done.stdout.splitlines() if line.startswith("|"))
    rest = [line for line in done.stdout.splitlines() if not line.startswith("|")]
    if done.returncode != 0:
        rest.append(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}")
    return table, "\n".join(rest).strip()


def export_gguf(root: Path, llama_cpp: str | None, run: str, out: str, outtype: str, ollama: bool,
                env: dict) -> str:
    """`erniekit-lite export RUN --to gguf` in a subprocess, with the server's llama.cpp: its output."""
    if outtype not in OUTTYPES:
        return f"error: type: {outtype} is not one of {', '.join(OUTTYPES)}"
    command = [sys.executable, "-m", "erniekit_lite", "export", run, "--to", "gguf", "--outtype", outtype, "--out", out]
    command += ["--ollama"] * ollama + ["--llama-cpp", llama_cpp] * bool(llama_cpp)
    env = {k: v for k, v in env.items() if k != "LLAMA_CPP_DIR"}  # the server's choice, passed explicitly
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    said = [line for line in done.stdout.splitlines() if line.startswith("export:")]
    if done.returncode != 0:
        said.append(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}")
    shown = "\n".join(said)
    return shown.replace(llama_cpp, "[llama.cpp]") if llama_cpp else shown  # the server's folder is not the page's


OUTTYPES = ("f16", "bf16", "f32", "q8_0", "q4_k_m", "q5_k_m", "q6_k")


class Serving:
    """The one `erniekit-lite serve` process of this web UI."""

    def __init__(self):
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.log: Path | None = None
        atexit.register(self.stop)

    def start(self, root: Path, run: str, engine: str, port: float | None, env: dict) -> str:
        if engine not in ("auto", "transformers", "vllm"):
            return f"error: engine: {engine} is not one of auto, transformers, vllm"
        port = int(port or 8000)
        with self.lock:
            if self.process is not None and self.process.poll() is None:
                return f"already serving at {self.url}; stop it first"
            with socket.socket() as probe:  # something else answering on the port would pass for our server
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    return f"error: port {port} is in use on 127.0.0.1; choose another"
            self.log = log_file = root / STATE_DIR / "serve.log"
            log_file.parent.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, "-m", "erniekit_lite", "serve", run, "--engine", engine, "--host", "127.0.0.1", "--port", str(port)]
            with open(log_file, "w") as log:
                self.process = process = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                          stdin=subprocess.DEVNULL, start_new_session=True)
            self.url = url = f"http://127.0.0.1:{port}/v1"
        deadline = time.time() + 600
        while True:
            if process.poll() is not None:
                lines = log_file.read_text(errors="replace").strip().splitlines()
                return f"serve: exited ({lines[-1] if lines else f'exit status {process.returncode}'})"
            try:
                urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    return f"still starting after 10 minutes: see {log_file} (Stop ends it)"
                time.sleep(1)
        said = [line for line in log_file.read_text(errors="replace").splitlines() if line.startswith("serve:")]
        return "\n".join([f"serving at {url}", *said])

    def stop(self) -> str:
        with self.lock:
            process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return "no server running"
        try:
            os.killpg(process.pid, signal.SIGINT)
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        except ProcessLookupError:
            pass
        return f"stopped the server at {self.url}"


SERVING = Serving()


def push(root: Path, run: str, repo: str, public: bool, merged: bool, token: str, env: dict) -> str:
    """`erniekit-lite push` in a subprocess (it calls `hub.push` with `hub.settings`); its output, token-free.
    Private unless `public`, as the CLI."""
    from erniekit_lite.hub import settings

    try:
        settings(repo, False if public else None, merged)  # the CLI's own check, answered before a process is started
    except UserError as e:
        return f"error: {e}"
    command = [sys.executable, "-m", "erniekit_lite", "push", run, "--repo", repo]
    command += ["--public"] * public + ["--merged"] * merged
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    output = (done.stdout + done.stderr).strip()
    return output.replace(token, "[token]") if token else output  # the CLI never prints it; make sure


def build(gate: Gate, llama_cpp: str | None = None) -> None:
    """The tab; `llama_cpp`: the server's llama.cpp folder (its command line or $LLAMA_CPP_DIR), never the page's."""
    root = gate.root
    with gr.Tab("Export", id="export") as tab:
        run = gr.Dropdown(model_dirs(root), value=None, allow_custom_value=True, label="run dir", elem_id="export-run")
        with gr.Row():
            with gr.Column():
                gr.Markdown("**Merge** a LoRA run into its base: a plain transformers checkpoint (no peft needed).")
                out = gr.Textbox(label="merged model dir", placeholder="runs/my-run-merged", elem_id="export-out")
                overwrite = gr.Checkbox(label="replace a previous merge in that dir")
                merge_button = gr.Button("Merge", elem_id="export-merge")
            with gr.Column():
                gr.Markdown("**Push** a finished run to the Hugging Face Hub, with a model card and the loss plot.")
                repo = gr.Textbox(label="repo id (USER/NAME)", elem_id="export-repo")
                with gr.Row():
                    public = gr.Checkbox(label="public (default: private)", elem_id="export-public")
                    merged = gr.Checkbox(label="merged (LoRA runs: push the adapter merged into its base)")
                shared = "required here" if gate.exposed else "blank: this server's HF_TOKEN or `hf auth login`"
                token = gr.Textbox(label=f"token (used for this push only; {shared})", type="password",
                                   elem_id="export-token")
                push_button = gr.Button("Push", elem_id="export-push")
        with gr.Row():
            with gr.Column():
                found = "llama.cpp set up on the server" if llama_cpp else "the server was started without llama.cpp (webui --llama-cpp DIR)"
                gr.Markdown(f"**GGUF** for llama.cpp and Ollama, made by llama.cpp's converter (a LoRA run is merged first; {found}).")
                with gr.Row():
                    gguf_out = gr.Textbox(label="GGUF output dir", placeholder="runs/my-run-gguf", elem_id="gguf-out")
                    outtype = gr.Dropdown(list(OUTTYPES), value="q8_0", label="type", elem_id="gguf-outtype")
                ollama = gr.Checkbox(label="also write an Ollama Modelfile", value=True, elem_id="gguf-ollama")
                gguf_button = gr.Button("Export GGUF", elem_id="gguf-run")
            with gr.Column():
                gr.Markdown("**Serve** the run behind an OpenAI-compatible URL on this machine (127.0.0.1); a LoRA run is merged once.")
                with gr.Row():
                    engine = gr.Dropdown(["auto", "transformers", "vllm"], value="auto", label="engine", elem_id="serve-engine")
                    port = gr.Number(label="port", value=8000, precision=0, elem_id="serve-port")
                with gr.Row():
                    serve_button = gr.Button("Start server", elem_id="serve-start")
                    stop_button = gr.Button("Stop server", elem_id="serve-stop")
        status = gr.Textbox(label="status", lines=6, interactive=False, elem_id="export-status")
        gr.Markdown("**Evaluate** the run on benchmarks through lm-evaluation-harness (its prompts and metrics), "
                    "beside its base when one is given. Standard tasks download their data from the Hub once.")
        with gr.Row():
            tasks = gr.Textbox(label="tasks (lm-eval names, comma-separated)", placeholder="mmlu,ceval-valid,gsm8k", elem_id="eval-tasks")
            tasks_path = gr.Textbox(label="folder of local task YAMLs (optional)", elem_id="eval-tasks-path")
            compare = gr.Textbox(label="base to compare with (optional)", placeholder="baidu/ERNIE-4.5-0.3B-PT", elem_id="eval-compare")
        with gr.Row():
            limit = gr.Number(label="examples per task (blank: all)", value=None, minimum=0, elem_id="eval-limit")
            chat = gr.Checkbox(label="render with the chat template", elem_id="eval-chat")
            eval_button = gr.Button("Evaluate", elem_id="eval-run")
        table = gr.Markdown(elem_id="eval-table")
        eval_status = gr.Textbox(label="evaluation output", lines=4, interactive=False, elem_id="eval-status")

        @gate.endpoint()
        def run_choices():
            return gr.update(choices=model_dirs(root))

        @gate.endpoint("model", "output", "plain")
        def merge_run(run_dir, merged_dir, replace):
            return merge(root, run_dir, merged_dir, replace)

        @gate.endpoint("model", "identity", "plain", "plain", "token", refuse=lambda line: ("", f"error: {line}"))
        def push_run(run_dir, repo_id, make_public, push_merged, typed_token):
            return "", push(root, run_dir, repo_id, make_public, push_merged, typed_token, gate.environment(typed_token))

        @gate.endpoint("model", "output", "plain", "plain")
        def gguf(run_dir, out_dir, kind, modelfile):
            return export_gguf(root, llama_cpp, run_dir, out_dir, kind, modelfile, gate.environment())

        @gate.endpoint("model", "plain", "plain")
        def serve(run_dir, engine_name, port_number):
            return SERVING.start(root, run_dir, engine_name, port_number, gate.environment())

        @gate.endpoint()
        def stop_serving():
            return SERVING.stop()

        @gate.endpoint("model", "tasks", "code?", "plain", "plain", "model?", refuse=lambda line: ("", f"error: {line}"))
        def evaluate_run(run_dir, task_names, task_folder, per_task, chat_template, base):
            return evaluate(root, run_dir, task_names, task_folder, per_task, chat_template, base, gate.environment())

        tab.select(run_choices, None, run)
        merge_button.click(merge_run, [run, out, overwrite], status)
        push_button.click(push_run, [run, repo, public, merged, token], [token, status])
        gguf_button.click(gguf, [run, gguf_out, outtype, ollama], status)
        serve_button.click(serve, [run, engine, port], status)
        stop_button.click(stop_serving, None, status)
        eval_button.click(evaluate_run, [run, tasks, tasks_path, limit, chat, compare], [table, eval_status])
