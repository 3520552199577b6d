"""GRPO prompts: records of any SFT format -> the prompt to generate from and, when present, a reference answer.

The last user turn is the prompt (earlier turns are its history); that turn's response, when the record has one, is
the reference answer the reward functions receive as `answer`. Also read: GSM8K-style `{"question", "answer"}`
(the answer's `#### 42` is what `exact_answer` compares) and TRL's prompt-only `{"prompt": str | messages}`; a
top-level `answer` (or `solution`) is the reference whatever the format. Prompt-only records need no response:

    gsm8k     {"question": "Natalia sold ...", "answer": "... #### 72"}
    trl       {"prompt": "What is 2+3?", "answer": "5"}  or  {"prompt": [{"role": "user", "content": ...}]}
    alpaca    {"instruction", "input"?, "output"?}                  output = the reference
    messages  {"messages": [..., {"role": "user", ...}, {"role": "assistant", ...}?]}
    sharegpt  {"conversations": [..., {"from": "human", ...}, {"from": "gpt", ...}?]}
    erniekit  {"src": [q1, .., qn], "tgt": [a1, .., a(n-1) or an]}

A prompt is kept as chat messages (system?, user/assistant history, user), the form TRL passes to reward functions,
and is rendered for generation by the template training uses (`prompt_ids`: ERNIE 4.5's pieces ending in
`Assistant: `, or the model's own template), with user text tokenized as text: it never becomes a control token.
Prompts longer than `data.max_length` tokens are dropped (and counted). Prompts are text: a record's `tools` list and
earlier turns' tool calls are not carried into them (TRL's tool-calling rollouts are not wired).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

from erniekit_lite.data import handoff
from erniekit_lite.data.formats import (
    Conversation,
    Turn,
    check_format,
    detect_format,
    to_conversation,
)
from erniekit_lite.data.load import Record, read_records
from erniekit_lite.data.template import template_for
from erniekit_lite.data.tokenize import Tokenizer
from erniekit_lite.errors import DataError
from erniekit_lite.recipe import DataSection, Source


@dataclass
class PromptItem:
    messages: list[dict]  # [system?] + history (user, assistant, ...) + the user prompt
    answer: str | None  # the reference answer, None when the record has none
    length: int  # prompt tokens as rendered for generation


@dataclass
class PromptSplit:
    items: list[PromptItem]
    dropped_overlong: int = 0
    sources: list[tuple[str, str, bool, int]] = field(default_factory=list)  # (path, format, detected, records)

    @property
    def lengths(self) -> list[int]:
        return [item.length for item in self.items]


@dataclass
class PreparedPrompts:
    train: PromptSplit
    eval: PromptSplit | None
    template: str


def prepare_prompts(data: DataSection, tokenizer, seed: int = 42, log=print, beside: Path | None = None) -> PreparedPrompts:
    with handoff.session(beside) as hand:
        return _prepare_prompts(data, tokenizer, seed, log, hand)


def _prepare_prompts(data: DataSection, tokenizer, seed: int, log, hand: handoff.HandOff) -> PreparedPrompts:
    tok = Tokenizer(tokenizer, template_for(tokenizer))
    train = _handed_split(data.train, data, tok, log, hand)
    where = ", ".join(s.path for s in data.train)
    if not train.items:
        raise DataError(where, f"no prompts left ({train.dropped_overlong} longer than data.max_length={data.max_length})")
    evaluation = _handed_split(data.eval, data, tok, log, hand) if data.eval else None
    if data.eval_split:
        items = train.items[:]
        random.Random(seed).shuffle(items)
        n_eval = max(1, round(len(items) * data.eval_split))
        if n_eval >= len(items):
            raise DataError(where, f"data.eval_split={data.eval_split} leaves no prompt to train on")
        evaluation = PromptSplit(items[:n_eval])
        train = PromptSplit(items[n_eval:], train.dropped_overlong, train.sources)
    return PreparedPrompts(train, evaluation, tok.template.name)


def _handed_split(sources: list[Source], data: DataSection, tok: Tokenizer, log, hand: handoff.HandOff) -> PromptSplit:
    """The split, read and measured by this machine's main process and handed to the others as JSON (data/handoff.py);
    a process that finds no hand-off reads the split itself."""
    with hand.main_first():
        path = hand.next()
        path = path.with_name(path.name + ".json") if path is not None else None
        if path is not None and hand.reader:
            try:
                saved = json.loads(path.read_text())
            except (OSError, ValueError):
                saved = None
            if saved is not None:
                for source_path, fmt, detected, _ in saved["sources"]:
                    if detected:  # the line a fresh read prints
                        log(f"{source_path}: prompt format auto-detected as '{fmt}'")
                log(f"data: prompts of {', '.join(s.path for s in sources)} read from this machine's main process")
                return PromptSplit([PromptItem(*item) for item in saved["items"]], saved["dropped_overlong"],
                                   [tuple(s) for s in saved["sources"]])
        split = _split(sources, data, tok, log)
        if path is not None and hand.writer:
            saved = {"items": [[i.messages, i.answer, i.length] for i in split.items],
                     "dropped_overlong": split.dropped_overlong, "sources": split.sources}
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(json.dumps(saved))
                os.replace(tmp, path)
                hand.written(path)
            except OSError as e:  # the other processes then read the prompts themselves
                log(f"data: {path.parent}: hand-off to this machine's other processes not written ({e}); each reads itself")
        return split


def _split(sources: list[Source], data: DataSection, tok: Tokenizer, log) -> PromptSplit:
    if any(s.weight is not None for s in sources):
        raise DataError(sources[0].path, "weight: method grpo reads its prompt sources whole; drop the weights")
    split = PromptSplit([])
    for source in sources:
        records = read_records(source.path, source.split, source.max_samples)
        if not records:
            raise DataError(source.path, "no records in this file")
        fmt = source.format if source.format != "auto" else detect_prompt_format(records[0])
        if source.format == "auto":
            log(f"{source.path}: prompt format auto-detected as '{fmt}'")
        split.sources.append((source.path, fmt, source.format == "auto", len(records)))
        for record in records:
            messages, answer = to_prompt(record, fmt, data.system)
            length = len(prompt_ids(tok, messages))
            if length > data.max_length:
                split.dropped_overlong += 1
                continue
            split.items.append(PromptItem(messages, answer, length))
    return split


def detect_prompt_format(record: Record) -> str:
    if isinstance(record.data, dict) and "question" in record.data and not {"chosen", "rejected"} & set(record.data):
        return "gsm8k"
    if isinstance(record.data, dict) and "prompt" in record.data:
        return "trl"
    return detect_format(record)


def to_prompt(record: Record, fmt: str, system: str | None = None) -> tuple[list[dict], str | None]:
    """(messages ending with the user prompt, reference answer or None) of one record."""
    data = record.fields()
    if fmt in ("gsm8k", "trl"):
        key = "question" if fmt == "gsm8k" else "prompt"
        prompt = data.get(key)
        if isinstance(prompt, str) and prompt.strip():
            record = Record({"messages": [{"role": "user", "content": prompt}]}, record.path, record.line)
        elif isinstance(prompt, list):
            record = Record({"messages": prompt}, record.path, record.line)
        else:
            raise record.error(f"'{key}' must be a non-empty string" + (" or a list of {role, content} messages" if fmt == "trl" else ""))
        conv = to_conversation(_with_empty_answer(record, "messages"), "messages", system)
    else:
        check_format(_with_empty_answer(record, fmt), fmt)
        conv = to_conversation(_with_empty_answer(record, fmt), fmt, system)
    *history, last = conv.turns
    reference = data.get("answer", data.get("solution"))
    if reference is not None and not isinstance(reference, (str, int, float)):
        raise record.error(f"'answer' must be a string or a number, got {type(reference).__name__}")
    if reference is None and last.assistant.strip():
        reference = last.assistant
    return conversation_messages(Conversation(history + [Turn(last.user, "")], conv.system)), \
        None if reference is None else str(reference)


def _with_empty_answer(record: Record, fmt: str) -> Record:
    """The record with an empty response after a final user turn, so the SFT parsers keep that turn as the prompt."""
    data = dict(record.data)
    if fmt == "alpaca":
        data.setdefault("output", "")
    elif fmt == "erniekit" and isinstance(data.get("src"), list) and isinstance(data.get("tgt"), list) \
            and len(data["tgt"]) == len(data["src"]) - 1:
        data["tgt"] = [*data["tgt"], ""]
    elif fmt in ("messages", "sharegpt"):
        key, role, answer = ("messages", "role", {"role": "assistant", "content": ""}) if fmt == "messages" else \
            ("conversations", "from", {"from": "gpt", "value": ""})
        items = data.get(key)
        if isinstance(items, list) and items and isinstance(items[-1], dict) and items[-1].get(role) not in ("assistant", "gpt", "bot"):
            data[key] = [*items, answer]
    return Record(data, record.path, record.line)


def conversation_messages(conv: Conversation) -> list[dict]:
    """A prompt conversation (its last turn's response empty) as chat messages: what reward functions receive."""
    messages = [{"role": "system", "content": conv.system}] if conv.system else []
    for turn in conv.turns[:-1]:
        messages += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": turn.assistant}]
    return messages + [{"role": "user", "content": conv.turns[-1].user}]


def _generation_pieces(tok: Tokenizer, messages: list[dict]):
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    rest = messages[1:] if system is not None else messages
    history = [Turn(rest[i]["content"], rest[i + 1]["content"], train=False) for i in range(0, len(rest) - 1, 2)]
    return tok.template.generation_prompt(system, history, rest[-1]["content"])


def prompt_ids(tok: Tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the generation prompt for `messages`, as training renders a prompt (template pieces, user text as
    text)."""
    pieces = _generation_pieces(tok, messages)
    encoded = iter(tok.encode_pieces(pieces))
    return [t for p in pieces for t in (next(encoded) if p.text is not None else p.ids)]


def prompt_text(tok: Tokenizer, messages: list[dict]) -> str:
    """The generation prompt for `messages` as text, control tokens spelled out: what `prompt_ids` encodes (the
    reward functions' `prompt_text`)."""
    return "".join(p.text if p.text is not None else tok.tokenizer.decode(list(p.ids)) for p in _generation_pieces(tok, messages))


def describe_prompts(data: PreparedPrompts) -> str:
    lines = [f"data: template {data.template}, prompts for GRPO (the last user turn; reference answers passed to the rewards)"]
    for path, fmt, detected, records in data.train.sources:
        lines.append(f"  {path} [{fmt}{' (auto)' if detected else ''}]: {records} records")
    lengths = sorted(data.train.lengths)
    answers = sum(item.answer is not None for item in data.train.items)
    lines.append(f"  train: {len(lengths)} prompts ({answers} with a reference answer), prompt tokens mean "
                 f"{sum(lengths) / len(lengths):.1f}, max {lengths[-1]}; {data.train.dropped_overlong} longer than "
                 "data.max_length dropped")
    if data.eval is not None:
        lines.append(f"  eval: {len(data.eval.items)} prompts")
    return "\n".join(lines)
