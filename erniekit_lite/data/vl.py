"""Image-text conversations for ERNIE-4.5-VL: records -> samples with their images, token types and 3D positions.

The released VL chat template (`VL_CHAT_TEMPLATE`; the copy it comes from and what was repaired in it: docs/vl.md)
renders a conversation as the text models' does, with each image in a user turn as

    Picture {n}:<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>

(n counts the conversation's images) and the generation prompt `\\nAssistant: <think>\\n\\n</think>\\n\\n` (no thinking).
A sample is that rendering with the placeholder repeated once per image token (the image's patch grid over the 2x2
merge), tokenized in pieces as the text template is (`data/template.py`): what the user wrote never becomes a control
token, markup always is. Each trained turn is its own sample whose prompt ends in the generation prompt the model
answers at inference; earlier turns are rendered as the template renders history.

Per token the model reads two types: `mm_token_type_ids` (RoPE: 1 on the image placeholders) and
`moe_mm_token_type_ids` (routing to the vision experts: the placeholders and the image start/end tokens), and a 3D
position (temporal, height, width): text advances all three by 1; an image's tokens take its grid's
(t, start+row, start+column) and the text after it starts at start + max(rows, columns) (`rope_positions`, the rule of
transformers' `Ernie4_5_VLMoeModel.get_rope_index`, which tests/test_vl.py compares it with). Positions start at 0 in
every sample, so a packed row's samples are each positioned as if alone.

Records: LLaMA-Factory's form (`messages` whose user texts hold `<image>` placeholders, and an `images` list of
paths, relative to the data file) and the Hugging Face content-part form (a message's `content` a list of
`{"type": "text", "text": ...}` and `{"type": "image", "image": PATH}`). Video is not supported.

Where `ERNIEKIT_IMAGES_INSIDE` is set (the web UI sets it to the folder it serves and the shipped demo data: its
visitors' records may name any path), an image path that resolves (links followed) outside those folders is refused
without being opened, so the refusal says nothing of what exists outside.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from erniekit_lite.data.template import BOS, EOS, EOT, Piece
from erniekit_lite.data.tokenize import IGNORE, Tokenizer, _extend
from erniekit_lite.errors import UserError

IMAGE, IMAGE_START, IMAGE_END = "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_START|>", "<|IMAGE_END|>"
IMAGES_INSIDE = "ERNIEKIT_IMAGES_INSIDE"  # folders (os.pathsep-separated) image paths must resolve inside, when set
PLACEHOLDER = "<image>"  # LLaMA-Factory's image placeholder in a message's text
NO_THINKING = "<think>\n\n</think>\n\n"  # the template's generation prompt ends with it unless thinking is asked for

# transformers' copy of the released template (tests/fixtures/ernie45_vl_chat_template.py.txt) with its two copying
# faults repaired (docs/vl.md): line breaks inside quoted strings re-indented, and a space in `<|end_of_sentence |>`
VL_CHAT_TEMPLATE = """
{%- set image_count = namespace(value=0) -%}
{%- set video_count = namespace(value=0) -%}
{{- '<|begin_of_sentence|>' }}
{%- for message in messages -%}
    {%- if message.role in ['system', 'user'] -%}
        {%- if message.role == 'user' -%}
            {{- 'User: ' -}}
        {%- endif -%}
        {%- if message.content is string -%}
            {{- message.content -}}
        {%- else -%}
            {%- for content_item in message.content -%}
                {%- if content_item.type == 'text' -%}
                    {{- content_item.text -}}
                {%- elif content_item.type in ['image_url', 'image'] -%}
                    {%- set image_count.value = image_count.value + 1 -%}
                    Picture {{ image_count.value }}:<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>
                {%- elif content_item.type in ['video_url', 'video'] -%}
                    {%- set video_count.value = video_count.value + 1 -%}
                    Video {{ video_count.value }}:<|VIDEO_START|><|VIDEO_PLACEHOLDER|><|VIDEO_END|>
                {%- endif -%}
            {%- endfor -%}
        {%- endif -%}
        {%- if message.role == 'system' -%}
            {{- '
' -}}
        {%- endif -%}
    {%- elif message.role == 'assistant' -%}
        {%- macro extract_text_content(content_field) -%}
            {%- if content_field is string -%}
                {{- content_field -}}
            {%- elif content_field is iterable and content_field is not string -%}
                {%- set ns = namespace(text_parts=[]) -%}
                {%- set text_parts = [] -%}
                {%- for item in content_field -%}
                    {%- if item.type == 'text' -%}
                        {%- set ns.text_parts = ns.text_parts + [item.text] -%}
                    {%- endif -%}
                {%- endfor -%}
                {{- ns.text_parts | join("") -}}
            {%- else -%}
                {{- '' -}}
            {%- endif -%}
        {%- endmacro -%}
        {%- set reasoning_content = extract_text_content(message.reasoning_content) -%}
        {%- set content = extract_text_content(message.content) -%}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('
').split('<think>')[-1].lstrip('
') %}
            {%- set content = content.split('</think>')[-1].lstrip('
') %}
        {%- endif %}
        {%- if reasoning_content %}
            {{- '
' + 'Assistant: ' + '<think>
' + reasoning_content.strip('
') + '
</think>
' + content.lstrip('
') }}
        {%- else %}
            {{- '
' + 'Assistant: ' + content }}
        {%- endif %}
        {{- '<|end_of_sentence|>' }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt is not defined or add_generation_prompt is true %}
    {{- '\nAssistant: ' -}}
    {%- if (enable_thinking is defined and enable_thinking is false) or enable_thinking is not defined %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
    {%- if enable_thinking is defined and enable_thinking is true %}{{- '<think>' }}{%- endif %}
{%- endif %}"""


@dataclass(frozen=True)
class Image:
    path: Path


@dataclass
class Message:
    role: str  # system | user | assistant
    parts: list  # str or Image, in order


@dataclass
class VLSample:
    input_ids: list[int]
    labels: list[int]
    image_types: list[int]  # mm_token_type_ids: 1 on image placeholders
    routing_types: list[int]  # moe_mm_token_type_ids: 1 on placeholders and image start/end
    positions: np.ndarray  # [3, n] int64: temporal, height, width
    pixel_values: list[np.ndarray] = field(default_factory=list)  # per image [patches, 3 x 14 x 14]
    grids: list[tuple[int, int, int]] = field(default_factory=list)  # per image (t, h, w) in patches

    def __len__(self) -> int:
        return len(self.input_ids)


def messages_of(record: dict, base: Path, where: str) -> list[Message]:
    """The record's messages with their images, in either form (module doc); `base`: the data file's folder."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: expected `messages`, a list of {{role, content}}")
    images = list(record.get("images") or [])
    if isinstance(record.get("images"), str):
        images = [record["images"]]
    pending = iter(images)
    used = 0
    out = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "user", "assistant"):
            raise UserError(f"{where}: messages[{i}].role: expected system, user or assistant (got {role!r})")
        parts: list = []
        if isinstance(content, str):
            pieces = content.split(PLACEHOLDER)
            for j, text in enumerate(pieces):
                if j:
                    path = next(pending, None)
                    if path is None:
                        raise UserError(f"{where}: {content.count(PLACEHOLDER) + used} {PLACEHOLDER} placeholders "
                                        f"and {len(images)} images: each placeholder takes the next path of `images`")
                    used += 1
                    parts.append(Image(_path(path, base, where)))
                if text:
                    parts.append(text)
        elif isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    parts.append(str(part.get("text", "")))
                elif kind in ("image", "image_url"):
                    ref = part.get("image") or part.get("path") or part.get("url") or part.get("image_url")
                    if isinstance(ref, dict):
                        ref = ref.get("url")
                    if not isinstance(ref, str):
                        raise UserError(f"{where}: messages[{i}]: an image part needs `image`: a file path")
                    parts.append(Image(_path(ref, base, where)))
                else:
                    raise UserError(f"{where}: messages[{i}].content: parts of type text or image only (got {kind!r})")
        else:
            raise UserError(f"{where}: messages[{i}].content: expected text or a list of parts")
        if role != "user" and any(isinstance(p, Image) for p in parts):
            raise UserError(f"{where}: messages[{i}]: images go in user messages")
        out.append(Message(role, parts))
    if used < len(images):
        raise UserError(f"{where}: {used} {PLACEHOLDER} placeholders and {len(images)} images: each image needs its "
                        f"placeholder in a user message")
    return out


def _path(ref: str, base: Path, where: str) -> Path:
    if ref.startswith(("http://", "https://")):
        raise UserError(f"{ref}: images are read from files here (nothing is downloaded); save it beside the data")
    path = Path(ref).expanduser()
    path = path if path.is_absolute() else base / path
    inside = [Path(folder) for folder in os.environ.get(IMAGES_INSIDE, "").split(os.pathsep) if folder]
    if inside and not any(path.resolve().is_relative_to(folder) for folder in inside):
        raise UserError(f"{where}: image {ref}: outside the folder this web UI serves; put the images beside the data in it")
    return path


def load_image(image: Image, processor, where: str) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The image resized and cut into patches by the released image processor: (pixel values, its (t, h, w) grid)."""
    from PIL import Image as PIL, UnidentifiedImageError

    try:
        with PIL.open(image.path) as opened:
            rgb = opened.convert("RGB")
    except FileNotFoundError:
        raise UserError(f"{where}: image {image.path}: no such file") from None
    except (UnidentifiedImageError, OSError) as error:
        raise UserError(f"{where}: image {image.path}: not a readable image ({error})") from None
    out = processor(images=[rgb], return_tensors="np")
    grid = tuple(int(x) for x in out["image_grid_thw"][0])
    return np.asarray(out["pixel_values"], dtype=np.float32), grid


def rope_positions(image_types: list[int], grids: list[tuple[int, int, int]], merge: int) -> np.ndarray:
    """[3, n] positions of one sample (module doc): the rule of transformers' `get_rope_index` for images."""
    parts, position, grid = [], 0, iter(grids)
    for kind, run in itertools.groupby(image_types):
        n = len(list(run))
        if kind == 0:
            parts.append(np.broadcast_to(np.arange(position, position + n), (3, n)))
            position += n
            continue
        t, h, w = next(grid)
        rows, columns = h // merge, w // merge
        if t * rows * columns != n:
            raise ValueError(f"an image's {n} placeholders do not match its grid {t}x{h}x{w} over the {merge}x{merge} merge")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(rows), np.arange(columns), indexing="ij")
        parts.append(np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + position)
        position += max(rows, columns)
    return np.concatenate(parts, axis=1).astype(np.int64) if parts else np.zeros((3, 0), np.int64)


class VLTemplate:
    """The released VL template as pieces (module doc), for one tokenizer and image processor."""

    def __init__(self, tokenizer, processor, merge: int = 2):
        self.tokenizer, self.processor, self.merge = tokenizer, processor, merge
        self.encoder = Tokenizer(tokenizer, None)
        vocab = tokenizer.get_vocab()
        missing = [t for t in (BOS, EOT, EOS, IMAGE, IMAGE_START, IMAGE_END) if t not in vocab]
        if missing:
            raise UserError(f"the tokenizer lacks the ERNIE-4.5-VL tokens {missing}: not a VL model's tokenizer")
        self.bos, self.eot, self.eos = vocab[BOS], vocab[EOT], vocab[EOS]
        self.image, self.start, self.end = vocab[IMAGE], vocab[IMAGE_START], vocab[IMAGE_END]
        # `<think>` as a control token (a tokenizer that has it) is markup: parsed; otherwise plain text
        self.think_special = "<think>" in (tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {})

    def samples(self, messages: list[Message], where: str) -> list[VLSample]:
        """One sample per assistant turn (module doc); images are read once per sample they appear in."""
        system = "".join(p for m in messages if m.role == "system" for p in m.parts) or None
        turns = [m for m in messages if m.role != "system"]
        if len(turns) % 2 or any(m.role != ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(turns)):
            raise UserError(f"{where}: messages: user and assistant turns in turn, starting with the user's")
        pairs = [(turns[i], turns[i + 1]) for i in range(0, len(turns), 2)]
        return [self.sample(system, pairs[:k], pairs[k][0], "".join(pairs[k][1].parts), where) for k in range(len(pairs))]

    def prompt_pieces(self, system: str | None, history, user: Message, loaded: list) -> list[Piece]:
        """The pieces up to the generation prompt; `loaded` collects each image's (pixel values, grid) in order."""
        pieces = [Piece(ids=(self.bos,))]
        text = f"{system}\n" if system else ""
        count = 0
        for k, (question, answer) in enumerate([*history, (user, None)]):
            text += "User: "
            for part in question.parts:
                if isinstance(part, str):
                    text += part
                    continue
                count += 1
                pixels, grid = load_image(part, self.processor, self._where)
                loaded.append((pixels, grid))
                tokens = grid[0] * grid[1] * grid[2] // self.merge**2
                pieces += [Piece(text + f"Picture {count}:"), Piece(ids=(self.start,) + (self.image,) * tokens + (self.end,))]
                text = ""
            text += "\nAssistant: "
            if answer is not None:  # history, as the template renders it (its end-of-turn token kept untrained)
                pieces += [Piece(text + "".join(answer.parts)), Piece(ids=(self.eot,))]
                text = ""
        if self.think_special:
            return pieces + [Piece(text), Piece(NO_THINKING, special=True)]
        return pieces + [Piece(text + NO_THINKING)]

    def prompt(self, system: str | None, history, user: Message, where: str) -> VLSample:
        """What inference feeds the model: the training sample's pieces up to the generation prompt."""
        self._where = where
        loaded: list = []
        pieces = self.prompt_pieces(system, history, user, loaded)
        ids: list[int] = []
        _extend(ids, [], pieces, iter(self.encoder.encode_pieces(pieces)))
        return self.build(ids, [IGNORE] * len(ids), loaded)

    def sample(self, system, history, user: Message, answer: str, where: str) -> VLSample:
        self._where = where
        loaded: list = []
        pieces = self.prompt_pieces(system, history, user, loaded)
        pieces += [Piece(answer, trained=True, response=True), Piece(ids=(self.eot,), trained=True, label_ids=(self.eos,), response=True)]
        ids: list[int] = []
        labels: list[int] = []
        _extend(ids, labels, pieces, iter(self.encoder.encode_pieces(pieces)))
        return self.build(ids, labels, loaded)

    def build(self, ids: list[int], labels: list[int], loaded: list) -> VLSample:
        image_types = [int(t == self.image) for t in ids]
        routing = [int(t in (self.image, self.start, self.end)) for t in ids]
        grids = [grid for _, grid in loaded]
        return VLSample(ids, labels, image_types, routing, rope_positions(image_types, grids, self.merge),
                        [pixels for pixels, _ in loaded], grids)


# Preference pairs with images (DPO): one prompt (its images) and two answers


def answer_text(value, where: str, key: str) -> str:
    """A pair's answer: text, an assistant message, or a list of them (TRL's conversational form)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value):
        return "".join(m["content"] for m in value)
    raise UserError(f"{where}: `{key}`: expected the answer as text or an assistant message")


@dataclass
class VLPair:
    chosen: VLSample
    rejected: VLSample

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)


def vl_pair(template: VLTemplate, fields: dict, base: Path, where: str) -> VLPair:
    """A record's pair: `messages` (the prompt, ending with the user's turn; `<image>` placeholders with `images`, or
    content parts), `chosen` and `rejected` answers."""
    for key in ("chosen", "rejected"):
        if key not in fields:
            raise UserError(f"{where}: a preference record needs `messages`, `chosen` and `rejected` (missing {key})")
    messages = messages_of(fields, base, where)
    system = "".join(p for m in messages if m.role == "system" for p in m.parts) or None
    turns = [m for m in messages if m.role != "system"]
    if not turns or len(turns) % 2 == 0 or any(m.role != ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(turns)):
        raise UserError(f"{where}: messages: the prompt's turns alternate user and assistant and end with the user's")
    history = [(turns[i], turns[i + 1]) for i in range(0, len(turns) - 1, 2)]
    chosen, rejected = (answer_text(fields[k], where, k) for k in ("chosen", "rejected"))
    return VLPair(template.sample(system, history, turns[-1], chosen, where),
                  template.sample(system, history, turns[-1], rejected, where))
