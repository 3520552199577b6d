"""The Gradio app: three tabs over one server-side job runner, served on 127.0.0.1 unless asked otherwise."""

from __future__ import annotations

import ipaddress
import time
from pathlib import Path

import gradio as gr

from erniekit_lite.errors import UserError
from erniekit_lite.webui import chat_tab, export_tab, train_tab
from erniekit_lite.webui.jobs import Runner


def build(exposed: bool = False) -> gr.Blocks:
    """The app for the working directory: paths are read from it, as the CLI reads them, and every path typed in
    the UI must stay inside it. `exposed`: others can reach it (`reachable_by_others`), so it runs no reward code of theirs."""
    root = Path.cwd()
    with gr.Blocks(title="erniekit-lite", analytics_enabled=False) as demo:
        gr.Markdown("## erniekit-lite: fine-tune ERNIE 4.5 from a recipe")
        with gr.Tabs():
            train_tab.build(demo, root, Runner(root), exposed)
            chat_tab.build(root)
            export_tab.build(root)
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


def launch(host: str, port: int, share: bool, auth: str | None) -> None:
    """Serve the app for the current directory until interrupted."""
    credentials = parse_auth(auth)
    demo = build(reachable_by_others(host, share, credentials))
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
