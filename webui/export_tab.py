"""Export tab: merge a LoRA run into a full model, push a run to the Hugging Face Hub, and evaluate a run on
lm-eval benchmarks against its base (`erniekit-lite eval --tasks ... --compare`).

A token typed here lives only in this request: it goes into the environment of the `erniekit-lite push`
subprocess (setting it in the server's own environment would hand it to every later job and page), is never
written, logged or shown, and the password box is cleared after the push.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gradio as gr

from erniekit_lite.errors import UserError
from webui.paths import confine, model_dirs


def merge(root: Path, run: str, out: str, overwrite: bool) -> str:
    from erniekit_lite.model.merge import merge as merge_run

    try:
        confine(root, run, "run dir")
        confine(root, out, "merged model dir")
        said: list[str] = []
        merged = merge_run(run, out, overwrite, log=said.append)
    except UserError as e:
        return f"error: {e}"
    return "\n".join([f"merged {run} into {merged}: loads with AutoModelForCausalLM.from_pretrained({str(merged)!r})", *said])


def evaluate(root: Path, run: str, tasks: str, tasks_path: str, limit: float | None, chat: bool, compare: str) -> tuple[str, str]:
    """`erniekit-lite eval RUN --tasks ... [--compare BASE]` in a subprocess (the model's memory is freed with it):
    the table it prints (Markdown) and the rest of its output."""
    try:
        confine(root, run, "run dir")
        if tasks_path.strip():
            confine(root, tasks_path, "tasks folder")
        if compare.strip():
            confine(root, compare, "base to compare with")
    except UserError as e:
        return "", f"error: {e}"
    if not tasks.strip():
        return "", "error: tasks: empty; enter lm-eval task names, e.g. mmlu,gsm8k"
    command = [sys.executable, "-m", "erniekit_lite", "eval", run.strip(), "--tasks", tasks.strip()]
    command += ["--tasks-path", tasks_path.strip()] * bool(tasks_path.strip()) + ["--compare", compare.strip()] * bool(compare.strip())
    command += ["--limit", f"{limit:g}"] * bool(limit) + ["--chat"] * chat
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    table = "\n".join(line for line in done.stdout.splitlines() if line.startswith("|"))
    rest = [line for line in done.stdout.splitlines() if not line.startswith("|")]
    if done.returncode != 0:
        rest.append(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}")
    return table, "\n".join(rest).strip()


def push(root: Path, run: str, repo: str, private: bool, merged: bool, token: str) -> str:
    """`erniekit-lite push` in a subprocess (it calls `hub.push` with `hub.settings`); its output, token-free."""
    from erniekit_lite.hub import settings

    try:
        settings(repo, private, merged)  # the CLI's own check, answered before a process is started
        confine(root, run, "run dir")
    except UserError as e:
        return f"error: {e}"
    command = [sys.executable, "-m", "erniekit_lite", "push", run, "--repo", repo]
    command += ["--private"] * private + ["--merged"] * merged
    env = {**os.environ, **({"HF_TOKEN": token} if token else {})}
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    output = (done.stdout + done.stderr).strip()
    return output.replace(token, "[token]") if token else output  # the CLI never prints it; make sure


def build(root: Path) -> None:
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
                    private = gr.Checkbox(label="private")
                    merged = gr.Checkbox(label="merged (LoRA runs: push the adapter merged into its base)")
                token = gr.Textbox(label="token (used for this push only; blank: HF_TOKEN or `hf auth login`)",
                                   type="password", elem_id="export-token")
                push_button = gr.Button("Push", elem_id="export-push")
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

        tab.select(lambda: gr.update(choices=model_dirs(root)), None, run)
        merge_button.click(lambda *a: merge(root, *a), [run, out, overwrite], status)
        push_button.click(lambda *a: ("", push(root, *a)), [run, repo, private, merged, token], [token, status])
        eval_button.click(lambda *a: evaluate(root, *a), [run, tasks, tasks_path, limit, chat, compare], [table, eval_status])
