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
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from erniekit_lite.data.template import BOS, EOS, EOT, Piece
from erniekit_lite.data.tokenize import IGNORE, Tokenizer, _extend
from erniekit_lite.errors import UserError

IMAGE, IMAGE_START, IMAGE_END = "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_START|>", "<|IMAGE_END|>"
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
                    parts.append(Image(_path(path, base)))
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
                    parts.append(Image(_path(ref, base)))
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


def _path(ref: str, base: Path) -> Path:
    if ref.startswith(("http://", "https://")):
        raise UserError(f"{ref}: images are read from files here (nothing is downloaded); save it beside the data")
    path = Path(ref).expanduser()
    return path if path.is_absolute() else base / path


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


@dataclass
class VLRow:
    """A packed row of VL samples (data.packing: false: one sample a row)."""

    samples: list[VLSample]

    @property
    def input_ids(self) -> list[int]:  # the packing-efficiency count reads the row's tokens
        return [t for s in self.samples for t in s.input_ids]


def prepare_vl(data, tokenizer, processor, seed: int = 42, log=print):
    """`data` (the recipe's data section) read into packed rows of VL samples: the SFT data of a VL run. A sample
    longer than data.max_length is dropped (cutting it could cut an image's tokens), counted like any other."""
    from erniekit_lite.data.load import read_records
    from erniekit_lite.data.packing import best_fit_decreasing
    from erniekit_lite.data.prepare import PreparedData, SourceReport, Split, _hold_out
    from erniekit_lite.data.tokenize import TokenStats

    template = VLTemplate(tokenizer, processor)

    def split(sources, pack_rows: bool = True):
        samples, stats, reports = [], TokenStats(), []
        for source in sources:
            records = read_records(source.path, source.split, source.max_samples)
            kept = 0
            for record in records:
                where = f"{record.path}:{record.line}"
                fields = record.fields()
                if data.system and not any(m.get("role") == "system" for m in fields.get("messages") or [] if isinstance(m, dict)):
                    fields = {**fields, "messages": [{"role": "system", "content": data.system}, *fields.get("messages", [])]}
                for sample in template.samples(messages_of(fields, Path(record.path).parent, where), where):
                    if len(sample) > data.max_length:
                        stats.dropped_overlong += 1
                        continue
                    stats.kept += 1
                    stats.lengths.append(len(sample))
                    stats.trained_tokens += sum(label != IGNORE for label in sample.labels)
                    samples.append(sample)
                    kept += 1
            reports.append(SourceReport(source.path, "vl messages", False, len(records), kept))
        return Split(rows(samples) if pack_rows else [], samples, stats, reports, max_length=data.max_length)

    def rows(samples):
        if not data.packing:
            return [VLRow([s]) for s in samples]
        return [VLRow([samples[i] for i in b]) for b in best_fit_decreasing([len(s) for s in samples], data.max_length)]

    train = split(data.train, pack_rows=not data.eval_split)
    if not train.samples:
        from erniekit_lite.errors import DataError

        raise DataError(", ".join(s.path for s in data.train), f"no image-text samples within data.max_length={data.max_length}")
    evaluation = split(data.eval) if data.eval else None
    if data.eval_split:
        held, kept = _hold_out(train.samples, data.eval_split, seed, train.sources[0].path)
        evaluation = Split(rows(held), held, TokenStats(), max_length=data.max_length)
        train = Split(rows(kept), kept, train.stats, train.sources, max_length=data.max_length)
    return PreparedData(train, evaluation, "ernie4.5-vl")


def index_dataset(start: int, count: int):
    """The `datasets.Dataset` the Trainer iterates (TRL takes no other kind): each item the index of a row the
    collator holds, so the images stay numpy arrays in memory rather than Arrow columns."""
    from datasets import Dataset

    return Dataset.from_dict({"row": list(range(start, start + count))})


@dataclass
class VLPackedCollator:
    """Rows of VL samples laid end to end as the text collator lays them (`collate.PackedCollator`), with the VL
    model's inputs: 3D positions [3, 1, T] restarting per sample, the routing types, and the rows' images (pixel
    values concatenated, one grid row per image)."""

    max_length: int
    rows: list[VLRow] = field(default_factory=list)  # what a dataset's `row` index names (`index_dataset`)

    def __call__(self, rows: list) -> dict:
        import torch

        from erniekit_lite.data.collate import bounds, host_facts

        rows = [self.rows[r["row"]] if isinstance(r, dict) else r for r in rows]
        samples = [s for row in rows for s in row.samples]
        _, varlen = bounds([len(s) for s in samples])
        labels = torch.tensor([t for s in samples for t in s.labels], dtype=torch.long)[None]
        batch = {
            "input_ids": torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.long)[None],
            "labels": labels,
            "position_ids": torch.from_numpy(np.concatenate([s.positions for s in samples], axis=1))[:, None],
            "moe_mm_token_type_ids": torch.tensor([t for s in samples for t in s.routing_types], dtype=torch.long)[None],
            **varlen,
            "token_slots": len(rows) * self.max_length,
            **host_facts(labels, labels.numel(), varlen["cu_seq_lens_q"]),
        }
        pixels = [p for s in samples for p in s.pixel_values]
        if pixels:
            batch["pixel_values"] = torch.from_numpy(np.concatenate(pixels))
            batch["image_grid_thw"] = torch.tensor([g for s in samples for g in s.grids], dtype=torch.long)
        return batch


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


@dataclass
class VLPairRow:
    """Whole pairs in a row: chosen, rejected, chosen, rejected, ..."""

    samples: list[VLSample]

    @property
    def input_ids(self) -> list[int]:
        return [t for s in self.samples for t in s.input_ids]


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


def prepare_vl_pairs(data, tokenizer, processor, seed: int = 42, log=print):
    """`data` read into packed rows of whole VL pairs (DPO), as `prepare_vl` reads SFT data; a pair with a sequence
    longer than data.max_length is skipped and counted."""
    from erniekit_lite.data.load import read_records
    from erniekit_lite.data.packing import best_fit_decreasing
    from erniekit_lite.data.pairs import PairStats
    from erniekit_lite.data.prepare import PairSplit, PreparedPairs, SourceReport, _hold_out

    template = VLTemplate(tokenizer, processor)

    def rows(pairs):
        groups = best_fit_decreasing([len(p) for p in pairs], 2 * data.max_length) if data.packing else [[i] for i in range(len(pairs))]
        return [VLPairRow([s for i in g for s in (pairs[i].chosen, pairs[i].rejected)]) for g in groups]

    def split(sources, pack_rows: bool = True):
        pairs, stats, reports = [], PairStats(), []
        for source in sources:
            records = read_records(source.path, source.split, source.max_samples)
            kept = 0
            for record in records:
                where = f"{record.path}:{record.line}"
                pair = vl_pair(template, record.fields(), Path(record.path).parent, where)
                if max(len(pair.chosen), len(pair.rejected)) > data.max_length:
                    stats.skipped["longer than max_length"] += 1
                    continue
                stats.kept += 1
                stats.lengths += [len(pair.chosen), len(pair.rejected)]
                pairs.append(pair)
                kept += 1
            reports.append(SourceReport(source.path, "vl pairs", False, len(records), kept))
        return PairSplit(rows(pairs) if pack_rows else [], pairs, stats, reports, max_length=data.max_length)

    train = split(data.train, pack_rows=not data.eval_split)
    if not train.pairs:
        from erniekit_lite.errors import DataError

        raise DataError(", ".join(s.path for s in data.train), f"no image-text pairs within data.max_length={data.max_length}")
    evaluation = split(data.eval) if data.eval else None
    if data.eval_split:
        held, kept = _hold_out(train.pairs, data.eval_split, seed, train.sources[0].path)
        evaluation = PairSplit(rows(held), held, PairStats(), max_length=data.max_length)
        train = PairSplit(rows(kept), kept, train.stats, train.sources, max_length=data.max_length)
    return PreparedPairs(train, evaluation, "ernie4.5-vl")


@dataclass
class VLPackedPairCollator:
    """Rows of VL pairs -> what `PackedPairCollator` (data/pairs.py) gives TRL's DPO loss (the padded [2B, L] layout,
    `logp_index`) and the packed sequence the model runs on, with the VL model's inputs under `packed_*` names (TRL
    hands every batch key to the model's forward; train/pair_scoring.py takes these)."""

    max_length: int
    rows: list[VLPairRow] = field(default_factory=list)

    def __call__(self, items: list) -> dict:
        import torch

        from erniekit_lite.data.collate import bounds, host_facts

        rows = [self.rows[r["row"]] if isinstance(r, dict) else r for r in items]
        samples = [s for row in rows for s in row.samples]
        lengths = [len(s) for s in samples]
        pairs, width = len(samples) // 2, max(lengths)
        padded = torch.zeros((2 * pairs, width), dtype=torch.long)
        attention = torch.zeros_like(padded)
        completion = torch.zeros_like(padded)
        index = []
        for k, s in enumerate(samples):
            row = k // 2 + (pairs if k % 2 else 0)  # chosen first, rejected second
            labels = torch.tensor(s.labels)
            padded[row, : len(s)] = torch.tensor(s.input_ids)
            attention[row, : len(s)] = 1
            completion[row, : len(s)] = (labels != IGNORE).long()
            index.append(row * (width - 1) + (labels[1:] != IGNORE).nonzero().flatten())
        ids = torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.long)[None]
        labels = torch.tensor([t for s in samples for t in s.labels], dtype=torch.long)[None]
        _, varlen = bounds(lengths)
        batch = {
            "input_ids": padded,
            "attention_mask": attention,
            "completion_mask": completion,
            "packed_input_ids": ids,
            "packed_labels": labels,
            "packed_position_ids": torch.from_numpy(np.concatenate([s.positions for s in samples], axis=1))[:, None],
            "packed_moe_mm_token_type_ids": torch.tensor([t for s in samples for t in s.routing_types], dtype=torch.long)[None],
            **varlen,
            "logp_index": torch.cat(index),
            "token_slots": len(rows) * 2 * self.max_length,
            "row_units": [len(row.samples) // 2 for row in rows],
            "chosen_tokens": int(completion[:pairs].sum()),
            **host_facts(labels, ids.numel(), varlen["cu_seq_lens_q"]),
        }
        pixels = [p for s in samples for p in s.pixel_values]
        if pixels:
            batch["packed_pixel_values"] = torch.from_numpy(np.concatenate(pixels))
            batch["packed_image_grid_thw"] = torch.tensor([g for s in samples for g in s.grids], dtype=torch.long)
        return batch
