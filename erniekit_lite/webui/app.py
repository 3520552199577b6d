"""The Gradio app: three tabs over one server-side job runner, served on 127.0.0.1 unless asked otherwise."""

from __future__ import annotations

import ipaddress
import os
import time
from pathlib import Path

import gradio as gr

from erniekit_lite.errors import UserError
from erniekit_lite.webui import chat_tab, export_tab, train_tab
from erniekit_lite.webui.gate import Gate
from erniekit_lite.webui.jobs import Runner


def build(exposed: bool = False, llama_cpp: str | None = None) -> gr.Blocks:
    """The app for the working directory: paths are read from it, as the CLI reads them, and every value a visitor
    sends passes the one gate (gate.py) first. `exposed`: others can reach it (`reachable_by_others`), so it runs
    no code, downloads nothing and pushes with no identity of the server's. `llama_cpp`: the server's llama.cpp
    folder for the GGUF export (default: $LLAMA_CPP_DIR), taken here, never from a page."""
    root = Path.cwd()
    gate = Gate(root, exposed)
    gate.confine_images()
    llama_cpp = llama_cpp or os.environ.get("LLAMA_CPP_DIR") or None
    with gr.Blocks(title="erniekit-lite", analytics_enabled=False) as demo:
        gr.Markdown("## erniekit-lite: fine-tune ERNIE 4.5 from a recipe")
        with gr.Tabs():
            train_tab.build(demo, gate, Runner(root, env=gate.environment))
            chat_tab.build(gate)
            export_tab.build(gate, str(Path(llama_cpp).expanduser().resolve()) if llama_cpp else None)
    return demo


def parse_auth(text: str | None) -> tuple[str, str] | None:
    if not text:
        return None
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise UserError("--auth / ERNIEKIT_WEBUI_AUTH: expected USER:PASSWORD")
    return user, password


def reachable_by_others(host: str, share: bool, auth) -> bool:
    """Whether people other than this machine's user can reach the UI: served on an address other than loopback, a
    public link, or a login (which is only there because others are meant to come in)."""
    if share or auth:
        return True
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: only `localhost` is known to stay on this machine
        return host != "localhost"


def launch(host: str, port: int, share: bool, auth: str | None, llama_cpp: str | None = None) -> None:
    """Serve the app for the current directory until interrupted."""
    credentials = parse_auth(auth)
    demo = build(reachable_by_others(host, share, credentials), llama_cpp)
    # quiet: Gradio's own lines advise `share=True` in `launch()`; this command's flag is --share
    demo.queue().launch(server_name=host, server_port=port, share=share, auth=credentials, css=train_tab.CSS, quiet=True,
                        prevent_thread_lock=True)
    public = f"; public link {demo.share_url}" if demo.share_url else " (a public link: --share)"
    print(f"erniekit-lite webui: {demo.local_url}{public}; Ctrl-C stops it", flush=True)
    serve_until_interrupted(demo)


def serve_until_interrupted(demo: gr.Blocks) -> None:
    """Serve until Ctrl-C, which goes on as KeyboardInterrupt: the CLI exits 130 then, as `train` and `serve` do
    (Gradio's `block_thread` would catch it and return, and the command exited 0)."""
    try:
        while demo.is_running:
            time.sleep(0.1)
    finally:
        demo.close()
