"""`erniekit-lite chat`: talk to a base model, a run's output dir, or a base + adapter, through the ERNIE template.

Prompts go through the same template pieces as training (`generate.answer`), so a tuned model sees at inference
exactly the boundary it was trained on; answers stream token by token and stop on `</s>`/`<|end_of_sentence|>`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from erniekit_lite.data.formats import Turn
from erniekit_lite.errors import UserError

HELP = "type a message; /reset clears the history, /exit (or Ctrl-D) quits"
IMAGE_HELP = "; /image FILE shows an image with your next message"
# A VL model asked about "this picture" with none shown still answers, about a picture it never saw: said once
NO_IMAGE = "no image shown: this ERNIE-4.5-VL model answers from the text alone"


def load(path: str, adapter: str | None = None):
    """Model and tokenizer for inference: bf16 on a CUDA GPU, fp32 on CPU, a QLoRA run on the 4-bit base it trained
    against (in the run's model.dtype: the adapter added to the original weights answers otherwise); KV cache on."""
    import torch

    from erniekit_lite.model.load import load_model, load_tokenizer
    from erniekit_lite.model.source import adapter_base, check_source, tokenizer_path, trained_in_4bit
    from erniekit_lite.model.lora import load_adapter

    check_source(path, named="")  # PATH is chat's own argument, not a recipe's model.path
    if adapter is not None and adapter_base(adapter) is None:
        raise UserError(f"--adapter: {adapter}: not a LoRA adapter dir (no adapter_config.json)")
    if adapter is not None and adapter_base(path) is not None:
        raise UserError(f"{path} already holds an adapter; give its base as PATH, or drop --adapter")
    from erniekit_lite.model.reward import refuse_reward_run

    for given in (path, adapter):
        refuse_reward_run(given, "chat")
    four_bit = trained_in_4bit(adapter or path)
    dtype = four_bit or ("bfloat16" if torch.cuda.is_available() else "float32")
    model = load_model(path, dtype, "sdpa", trainable_adapter=False, load_in_4bit=bool(four_bit))
    if adapter is not None:
        model = load_adapter(model, adapter, trainable=False)
    if torch.cuda.is_available():
        model = model.to("cuda")
    model.config.use_cache = True
    model.eval()
    return model, load_tokenizer(tokenizer_path(adapter or path))


def image_processor_of(model, path: str, adapter: str | None = None):
    """A VL model's image processor (from the run dir, else its base), None for a text model."""
    from erniekit_lite.model.vl import is_vl, processor_for

    return processor_for(adapter or path) if is_vl(model.config) else None


def reply(model, tokenizer, prompt: str, system: str | None, history: list[Turn], out=None, images: list[str] = (),
          processor=None, **sampling) -> str:
    """Stream one answer to `out` (default: stdout) and return it. `images`: files shown with the prompt (a VL
    model, whose image `processor` reads them)."""
    from transformers import TextStreamer

    out = out or sys.stdout
    from erniekit_lite.generate import answer, image_answer

    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    streamer.on_finalized_text = lambda text, stream_end=False: print(text, end="" if not stream_end else "\n", file=out, flush=True)
    if processor is None:
        if images:
            raise UserError("--image: this model reads text only (ERNIE-4.5-VL models take images)")
        return answer(model, tokenizer, prompt, system=system, history=history, streamer=streamer, **sampling)
    from erniekit_lite.data.vl import Image, Message

    past = [(Message("user", list(turn.user) if isinstance(turn.user, list) else [turn.user]), Message("assistant", [turn.assistant]))
            for turn in history]
    user = [Image(Path(f).expanduser()) for f in images] + ([prompt] if prompt else [])
    return image_answer(model, tokenizer, processor, user, system, past, streamer=streamer, **sampling)


def chat(model, tokenizer, system: str | None = None, read=None, out=None, processor=None, **sampling) -> None:
    """Interactive loop; the conversation so far is the history of each new prompt. A VL model (its image
    `processor` given) takes `/image FILE` lines: the images go with the next message."""
    read, out = read or input, out or sys.stdout
    history: list[Turn] = []
    images: list[str] = []
    print(HELP + (IMAGE_HELP if processor is not None else ""), file=out)
    while True:
        try:
            prompt = read("User: ").strip()
        except EOFError:
            print(file=out)
            return
        if prompt in ("/exit", "/quit"):
            return
        if prompt == "/reset":
            history, images = [], []
            print("(history cleared)", file=out)
            continue
        if prompt.startswith("/image") and processor is not None:
            file = prompt.removeprefix("/image").strip()
            if not Path(file).expanduser().is_file():
                print(f"(no such file: {file})", file=out)
            else:
                images.append(file)
                print(f"(image {len(images)} goes with your next message)", file=out)
            continue
        if not prompt:
            continue
        if processor is not None and not images and not any(isinstance(turn.user, list) for turn in history):
            print(f"({NO_IMAGE}; /image FILE shows one)", file=out)
        print("Assistant: ", end="", file=out, flush=True)
        try:
            said = reply(model, tokenizer, prompt, system, history, out, images, processor, **sampling)
        except UserError as error:  # an unreadable image: said, and the conversation goes on
            print(f"(error: {error})", file=out)
            images = []
            continue
        from erniekit_lite.data.vl import Image

        user = [Image(Path(f).expanduser()) for f in images] + [prompt] if images else prompt  # a VL turn: its parts
        history.append(Turn(user, said))
        images = []


def sampling_settings(max_new_tokens: int, temperature: float, top_p: float) -> dict:
    """Greedy at temperature 0 (deterministic), else nucleus sampling."""
    if temperature < 0 or not 0 < top_p <= 1 or max_new_tokens < 1:
        raise UserError("chat: expected --temperature >= 0, 0 < --top-p <= 1 and --max-new-tokens >= 1")
    if temperature == 0:
        return {"max_new_tokens": max_new_tokens, "do_sample": False}
    return {"max_new_tokens": max_new_tokens, "do_sample": True, "temperature": temperature, "top_p": top_p}
