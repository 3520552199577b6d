"""Chat tab: load a base model or a run's output dir, stream answers through the ERNIE template, and optionally
answer the same prompt with a second model (the run's base, filled in when a run is chosen) side by side."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import gradio as gr

from erniekit_lite.data.formats import Turn
from erniekit_lite.errors import UserError
from erniekit_lite.webui.gate import Gate
from erniekit_lite.webui.paths import model_dirs


class Models:
    """Loaded models by path (each admitted by the gate), shared by every page; at most two (the model and the one it
    is compared with)."""

    LIMIT = 2

    def __init__(self, root: Path):
        self.root = root
        self.loaded: dict[str, tuple] = {}
        self._lock = threading.Lock()  # one load at a time: two pages loading the same model would load it twice

    def get(self, path: str):
        from erniekit_lite.chat import load

        with self._lock:
            if path not in self.loaded:
                while len(self.loaded) >= self.LIMIT:
                    self.loaded.pop(next(iter(self.loaded)))
                self.loaded[path] = load(path)  # relative paths: the server runs in root
            return self.loaded[path]


def base_of(path: str) -> str:
    """What a run was trained from (an adapter's base, or the model.path of its recipe.yaml); "" if not a run."""
    from erniekit_lite import recipe as recipes
    from erniekit_lite.model.source import adapter_base

    if adapter_base(path):
        return adapter_base(path)
    run_recipe = Path(path) / "recipe.yaml"
    return recipes.load(run_recipe).model.path if run_recipe.is_file() else ""


def stream(model, tokenizer, prompt: str, system: str | None, history: list[Turn], sampling: dict, image: str | None = None,
           processor=None):
    """Yield the answer so far as tokens arrive (generation runs in a thread), then the exact final answer. `image`: a
    file shown with the prompt to an ERNIE-4.5-VL model (its image `processor` given); earlier turns go as text."""
    from transformers import TextIteratorStreamer

    from erniekit_lite.generate import answer, image_answer

    if image and processor is None:
        raise UserError("this model reads text only (ERNIE-4.5-VL models take images); remove the image")
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result: dict = {}

    def respond():
        if processor is None:
            return answer(model, tokenizer, prompt, system=system, history=history, streamer=streamer, **sampling)
        from erniekit_lite.data.vl import Image, Message

        past = [(Message("user", [t.user]), Message("assistant", [t.assistant])) for t in history]
        user = ([Image(Path(image))] if image else []) + [prompt]
        return image_answer(model, tokenizer, processor, user, system, past, streamer=streamer, **sampling)

    def generate():
        try:
            result["text"] = respond()
        except Exception as e:  # re-raised below; ending the stream keeps the reader from waiting forever
            result["error"] = e
            streamer.end()

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    text = ""
    for piece in streamer:
        text += piece
        yield text
    thread.join()
    if "error" in result:
        raise result["error"]
    yield result["text"]


def turns(messages: list[dict]) -> list[Turn]:
    """Chatbot messages (user, assistant, user, ...) as the history `generate.answer` takes."""
    texts = [_text(m["content"]) for m in messages]
    return [Turn(user, assistant) for user, assistant in zip(texts[0::2], texts[1::2])]


def _text(content) -> str:
    # Gradio 6 hands messages back as lists of parts ({"type": "text", "text": ...})
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)


def build(gate: Gate) -> None:
    root = gate.root
    models = Models(root)
    with gr.Tab("Chat", id="chat") as tab:
        with gr.Row():
            path = gr.Dropdown(model_dirs(root), value=None, allow_custom_value=True, label="model or run dir (or Hub id)",
                               elem_id="chat-model")
            other = gr.Textbox(label="compare with (side by side; blank: off)", elem_id="chat-compare")
            load_button = gr.Button("Load", elem_id="chat-load")
        status = gr.Textbox(label="status", interactive=False, elem_id="chat-status")
        loaded = gr.State(("", ""))  # this page's (model, compared) paths
        with gr.Accordion("generation settings", open=False):
            system = gr.Textbox(label="system prompt")
            max_new_tokens = gr.Slider(1, 2048, value=256, step=1, label="max new tokens", elem_id="chat-max-new-tokens")
            temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0: greedy, deterministic)")
            top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top-p")
        with gr.Row():
            first = gr.Chatbot(label="model", elem_id="chat-first")
            second = gr.Chatbot(label="compared", visible=False, elem_id="chat-second")
        with gr.Row():
            message = gr.Textbox(label="message", placeholder="type and press Enter", elem_id="chat-message", scale=4)
            image = gr.Image(type="filepath", label="image (ERNIE-4.5-VL models; goes with the next message)", height=120,
                             elem_id="chat-image", scale=1)
        with gr.Row():
            send_button = gr.Button("Send", variant="primary", elem_id="chat-send")
            clear_button = gr.Button("Clear")

        @gate.endpoint("model?", refuse=lambda line: "")  # outside (Load will say so): no base to offer
        def chosen(model_path: str):
            try:
                return base_of(model_path) if model_path else ""
            except UserError:  # a run with a broken recipe.yaml
                return ""

        @gate.endpoint("model?", "model?", refuse=lambda line: (gr.skip(), gr.skip(), gr.skip(), f"error: {line}"))
        def load(model_path: str, other_path: str):
            if not model_path:
                return gr.skip(), gr.skip(), gr.skip(), "choose a model or run dir first"
            try:
                for p in filter(None, (model_path, other_path)):
                    models.get(p)
            except UserError as e:
                return gr.skip(), gr.skip(), gr.skip(), f"error: {e}"
            pair = (model_path, other_path)
            return (pair, gr.update(value=[], label=model_path), gr.update(value=[], label=pair[1], visible=bool(pair[1])),
                    f"loaded {' and '.join(filter(None, pair))}")

        @gate.endpoint("plain", "upload?", "state", "plain", "plain", "plain", "plain", "plain", "plain",
                       refuse=lambda line: (gr.skip(), None, gr.skip(), gr.skip(), f"error: {line}"))
        def send(text: str, picture: str | None, pair, history_a, history_b, system_prompt, max_new, temp, nucleus):
            from erniekit_lite.chat import image_processor_of, sampling_settings

            if not pair[0]:
                yield gr.skip(), gr.skip(), gr.skip(), gr.skip(), "load a model first"
                return
            if not text.strip():
                yield gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
                return
            sampling = sampling_settings(int(max_new), float(temp), float(nucleus))
            histories, started = [history_a, history_b], time.time()
            picture = str(picture) if picture else None
            shown = f"{text}\n(with an image)" if picture else text
            # One model after the other: on a CPU two generations at once would each run at half speed
            for i, p in enumerate(filter(None, pair)):
                model, tokenizer = models.get(p)
                before = histories[i]
                try:
                    processor = image_processor_of(model, p)
                    for answer in stream(model, tokenizer, text, system_prompt or None, turns(before), sampling, picture, processor):
                        histories[i] = before + [{"role": "user", "content": shown}, {"role": "assistant", "content": answer}]
                        yield "", None, histories[0], histories[1], ""
                except UserError as e:
                    yield gr.skip(), gr.skip(), histories[0], histories[1], f"error ({p}): {e}"
                    return
            yield "", None, histories[0], histories[1], f"answered in {time.time() - started:.1f} s"

        @gate.endpoint()
        def model_choices():
            return gr.update(choices=model_dirs(root))

        @gate.endpoint()
        def clear():
            return [], []

        tab.select(model_choices, None, path)
        path.input(chosen, path, other)
        load_button.click(load, [path, other], [loaded, first, second, status])
        inputs = [message, image, loaded, first, second, system, max_new_tokens, temperature, top_p]
        message.submit(send, inputs, [message, image, first, second, status])
        send_button.click(send, inputs, [message, image, first, second, status])
        clear_button.click(clear, None, [first, second])
