"""The ERNIE 4.5 chat format as pieces to tokenize separately, each marked trained or not.

Released template (ERNIE-4.5-0.3B-PT and 21B-A3B-PT):

    <|begin_of_sentence|>{system}\\n            (system line only when there is one)
    User: {q1}\\nAssistant: {a1}<|end_of_sentence|>
    User: {q2}\\nAssistant: {a2}<|end_of_sentence|>

Each turn is cut into a prompt piece ending in the generation prompt `Assistant: ` and a response piece, and
the two are tokenized separately. `Assistant: ` then ends in the token `▁`, exactly what inference feeds the
model before it generates; tokenizing the whole string would fuse the space into the response (`▁Hello`) and
train on a sequence the model never sees. As in ERNIEKit, the label of each `<|end_of_sentence|>` is `</s>`,
the eos of the released `generation_config.json`, so a tuned model stops where generation expects.

User text is tokenized with special-token parsing off: a user who types `<|end_of_sentence|>` gets those
characters, never the control token. Control tokens come only from the template: as ids here, as the markup a
model's own template renders around the messages (`ModelTemplate`), never from the text of a user, system or tool
message or from a string of the tool list or of a tool call, whichever template runs.

Tool traffic: this template has no tool role, so the tool list follows the system prompt as JSON, an assistant's
tool calls follow its text as a JSON list (trained with the rest of the response), and a tool result is the next
user turn (`with_tools` / `with_calls` in formats.py, shared with preference records). A model whose tokenizer
ships its own template (ERNIE-4.5-21B-A3B-Thinking) gets tools, calls and results in that template's own slots
(`ModelTemplate`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from erniekit_lite.data.formats import Conversation, Turn, with_calls, with_tools
from erniekit_lite.errors import UserError

ERNIE_CHAT_TEMPLATE = (
    "{%- if not add_generation_prompt is defined -%}\n"
    "    {%- set add_generation_prompt = true -%}\n"
    "{%- endif -%}\n"
    "{%- if not cls_token is defined -%}\n"
    '    {%- set cls_token = "<|begin_of_sentence|>" -%}\n'
    "{%- endif -%}\n"
    "{%- if not sep_token is defined -%}\n"
    '    {%- set sep_token = "<|end_of_sentence|>" -%}\n'
    "{%- endif -%}\n"
    "{{- cls_token -}}\n"
    "{%- for message in messages -%}\n"
    '    {%- if message["role"] == "user" -%}\n'
    '        {{- "User: " + message["content"] + "\n" -}}\n'
    '    {%- elif message["role"] == "assistant" -%}\n'
    '        {{- "Assistant: " + message["content"] + sep_token -}}\n'
    '    {%- elif message["role"] == "system" -%}\n'
    '        {{- message["content"] + "\n" -}}\n'
    "    {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    '    {{- "Assistant: " -}}\n'
    "{%- endif -%}"
)
BOS = "<|begin_of_sentence|>"
EOT = "<|end_of_sentence|>"
EOS = "</s>"


@dataclass(slots=True)
class Piece:
    """A run of tokens: text or fixed ids. Text is tokenized without special-token parsing unless `special`: a model
    template's own markup, whose control tokens are spelled out in it."""

    text: str | None = None
    ids: tuple[int, ...] = ()
    trained: bool = False
    label_ids: tuple[int, ...] | None = None  # labels for `ids` when they differ from the ids (eot -> eos)
    response: bool = False  # part of the assistant's answer (trained unless the turn is masked)
    special: bool = False  # parse control-token spellings in `text` (template markup only)


class ErnieTemplate:
    name = "ernie4.5"

    def __init__(self, tokenizer):
        ids = _token_ids(tokenizer, (BOS, EOT, EOS))
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"tokenizer lacks the ERNIE 4.5 control tokens {missing}")
        self.bos_id, self.eot_id, self.eos_id = ids[BOS], ids[EOT], ids[EOS]
        self._bos = Piece(ids=(self.bos_id,))
        self._eot = {
            trained: Piece(ids=(self.eot_id,), trained=trained, label_ids=(self.eos_id,), response=True) for trained in (False, True)
        }

    def prompt_text(self, system: str | None, turn_index: int, user: str) -> str:
        head = f"{system}\n" if (turn_index == 0 and system) else ""
        return f"{head}User: {user}\nAssistant: "

    def pieces(self, conv: Conversation) -> list[list[Piece]]:
        """One list of pieces per turn: [prompt, response, end-of-turn]; the first turn starts with BOS."""
        system = with_tools(conv.system, conv.tools)
        turns = []
        for i, turn in enumerate(conv.turns):
            # BOS and end-of-turn pieces are shared between conversations: pieces are read, never changed
            lead = [self._bos] if i == 0 else []
            turns.append(
                lead
                + [
                    Piece(self.prompt_text(system, i, turn.user)),
                    Piece(with_calls(turn.assistant, turn.tool_calls), trained=turn.train, response=True),
                    self._eot[bool(turn.train)],
                ]
            )
        return turns

    def expand(self, conv: Conversation) -> list[Conversation]:
        """ERNIE's template renders every conversation as a prefix of its continuation: one sample each."""
        return [conv]

    def generation_prompt(self, system: str | None, history: list[Turn], user: str) -> list[Piece]:
        """What inference feeds the model: the same pieces as training, ending in `Assistant: `."""
        conv = Conversation(history + [Turn(user, "")], system)
        *done, last = self.pieces(conv)
        flat = [p for turn in done for p in turn]
        return flat + last[:-2]


def _token_ids(tokenizer, tokens: tuple[str, ...]) -> dict[str, int | None]:
    """Each token's id, None when the vocabulary (added tokens included) lacks it. A fast tokenizer answers
    directly; `get_vocab()` builds a 100k-entry dict (a quarter of a second for ERNIE 4.5)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return {t: backend.token_to_id(t) for t in tokens}
    vocab = tokenizer.get_vocab()
    return {t: vocab.get(t) for t in tokens}


class ModelTemplate:
    """A chat template shipped with the model that is not ERNIE's: turns are cut by rendering growing prefixes.

    Turn i's prompt piece is what the template adds for its user (or tool) message plus the generation prompt; its
    response piece is what the template adds for the assistant message (text, tool calls, end of turn), trained.
    A template that rewrites earlier turns (the Thinking model's drops their reasoning once a later turn follows)
    renders no conversation as a prefix of its continuation: `expand` then makes each trained assistant turn its own
    sample, whose prompt is the conversation so far as the template renders it for generation (what the model sees
    at inference) and whose completion is that turn. A template that cannot give even that (it always appends the
    generation prompt, say) is refused with a UserError.
    Control tokens come from the template's markup, parsed as control tokens. The text of user, system and tool
    messages, and each string of the tool list or of a tool call that spells a control token, is found in the
    rendering by rendering placeholders in its place (`_segments`) and is tokenized as plain text, as ERNIE's
    template does with it.
    """

    name = "model"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.chat_template = honour_generation_flag(tokenizer)
        self._control = _ControlSpellings(tokenizer)

    def _render(self, messages: list[dict], generation_prompt: bool, tools: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=function_tools(tools) or None, tokenize=False, add_generation_prompt=generation_prompt,
            chat_template=self.chat_template,
        )

    def _segments(self, messages: list[dict], generation_prompt: bool, tools: list[dict]) -> tuple[str, list[tuple[int, int, bool]]]:
        """The rendering, and its (start, end, is markup) spans: markup, or text that is text.

        Text that is text: the text of a user/system/tool message, and each string of the tool list or of an
        assistant's tool calls (a key or a value: a function's name, a description, an argument) that holds a control
        token's spelling, or part of one at its start or end (any other string tokenizes as it would inside the markup,
        and templates test such strings: `tool.type == 'function'`). The template renders once with each such text
        replaced by a placeholder (one per distinct string in tools and calls, so that the template compares them as
        it compares the strings); walking both renderings side by side, each placeholder takes the text the real
        rendering has there: the text as written, trimmed (a template may strip whitespace), or escaped as a JSON
        string (`tojson`). A template that changes the text otherwise is refused."""
        real = self._render(messages, generation_prompt, tools)
        texts: list[tuple[str, bool]] = []  # (text, is a message's text)
        shared: dict[str, int] = {}  # a string of tools/calls -> its placeholder's index
        masked = []
        for m in messages:
            if m["role"] in TEXT_ROLES and m.get("content"):
                if "\ue000" in m["content"]:
                    raise UserError(f"a {m['role']} message contains U+E000, the private-use character erniekit-lite "
                                    "uses to find message text in the model's chat template")
                texts.append((m["content"], True))
                m = {**m, "content": f"\ue000{len(texts) - 1}\ue001"}
            if m.get("tool_calls"):
                m = {**m, "tool_calls": self._hide(m["tool_calls"], texts, shared)}
            masked.append(m)
        masked_tools = self._hide(tools, texts, shared) if tools else tools
        if not texts:
            return real, [(0, len(real), True)] if real else []
        parts = PLACEHOLDER.split(self._render(masked, generation_prompt, masked_tools))  # markup, index, markup, ...
        spans, pos = [], 0
        for k in range(0, len(parts), 2):
            markup = parts[k]
            if not real.startswith(markup, pos):
                raise UserError(f"the model's chat template renders {markup[:40]!r} differently when a message's text "
                                "or a string of its tools changes; erniekit-lite cannot tell its markup from that text")
            if markup:
                spans.append((pos, pos + len(markup), True))
            pos += len(markup)
            if k + 1 == len(parts):
                break
            (text, message), following = texts[int(parts[k + 1])], parts[k + 2]
            last = k + 3 == len(parts)
            found = next(
                (t for t in _renderings(text)
                 if real.startswith(t + following, pos) and (not last or pos + len(t) + len(following) == len(real))),
                None,
            )
            if found is None:
                if message:
                    raise UserError(f"the model's chat template changes the text of a message ({text[:40]!r}) beyond "
                                    "trimming whitespace; erniekit-lite needs message text inserted as written")
                raise UserError(f"the model's chat template changes a string of the tool list or of a tool call "
                                f"({text[:40]!r}) beyond trimming whitespace or escaping it as JSON; erniekit-lite needs "
                                "it inserted as written")
            if found:
                spans.append((pos, pos + len(found), False))
            pos += len(found)
        if pos != len(real):
            raise UserError("the model's chat template renders differently when a message's text or a string of its "
                            "tools changes; erniekit-lite cannot tell its markup from that text")
        return real, spans

    def _hide(self, value, texts: list[tuple[str, bool]], shared: dict[str, int]):
        """`value` (the tool list or a message's tool calls: JSON values) with each string, key or value, that holds a
        control token's spelling (or part of one at an end) replaced by its placeholder; equal strings share one."""
        if isinstance(value, str):
            if "\ue000" in value:
                raise UserError("a tool definition or tool call contains U+E000, the private-use character "
                                "erniekit-lite uses to find text in the model's chat template")
            if not self._control.touches(value):
                return value
            if value not in shared:
                shared[value] = len(texts)
                texts.append((value, False))
            return f"\ue000{shared[value]}\ue001"
        if isinstance(value, dict):
            return {self._hide(k, texts, shared): self._hide(v, texts, shared) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._hide(v, texts, shared) for v in value)
        return value

    def _pieces(self, spans, start: int, end: int, text: str, **kwargs) -> list[Piece]:
        """Pieces for `text[start:end]`, cut where markup and message text meet."""
        return [
            Piece(text=text[max(a, start) : min(b, end)], special=markup, **kwargs)
            for a, b, markup in spans
            if min(b, end) > max(a, start)
        ]

    def expand(self, conv: Conversation) -> list[Conversation]:
        """The conversation as one sample, or, when the template rewrites its earlier turns, one per trained turn
        (the turns before it as untrained context)."""
        try:
            self._turn_by_turn(conv)
            return [conv]
        except RewritesHistory:
            return [
                replace(conv, turns=[replace(t, train=False) for t in conv.turns[:i]] + [turn])
                for i, turn in enumerate(conv.turns)
                if turn.train
            ] or [conv]

    def pieces(self, conv: Conversation) -> list[list[Piece]]:
        """One list of pieces per turn; a conversation whose template rewrites its history and whose earlier turns are
        context only (as `expand` makes them, and as preference pairs are) is one turn: all but the last answer
        rendered as the generation prompt, then that answer."""
        try:
            return self._turn_by_turn(conv)
        except RewritesHistory:
            if len(conv.turns) == 1 or any(t.train for t in conv.turns[:-1]):
                raise
        messages = [{"role": "system", "content": conv.system}] if conv.system else []
        for turn in conv.turns[:-1]:
            messages += _chat_messages(turn)
        prompt_message, answer = _chat_messages(conv.turns[-1])
        prompt = self._render(messages + [prompt_message], True, conv.tools)
        full, spans = self._segments(messages + [prompt_message, answer], False, conv.tools)
        _check_extends(prompt, full, len(conv.turns))
        last = conv.turns[-1]
        return [self._pieces(spans, 0, len(prompt), full) + self._pieces(spans, len(prompt), len(full), full, trained=last.train, response=True)]

    def _turn_by_turn(self, conv: Conversation) -> list[list[Piece]]:
        messages = [{"role": "system", "content": conv.system}] if conv.system else []
        done, turns = "", []
        for i, turn in enumerate(conv.turns):
            prompt_message, answer = _chat_messages(turn)
            prompt = self._render(messages + [prompt_message], True, conv.tools)
            messages += [prompt_message, answer]
            full, spans = self._segments(messages, False, conv.tools)
            _check_extends(done, prompt, i + 1)
            _check_extends(prompt, full, i + 1)
            turns.append(
                self._pieces(spans, len(done), len(prompt), full)
                + self._pieces(spans, len(prompt), len(full), full, trained=turn.train, response=True)
            )
            done = full
        return turns

    def generation_prompt(self, system: str | None, history: list[Turn], user: str) -> list[Piece]:
        messages = [{"role": "system", "content": system}] if system else []
        for t in history:
            messages += _chat_messages(t)
        messages.append({"role": "user", "content": user})
        text, spans = self._segments(messages, True, [])
        return self._pieces(spans, 0, len(text), text)


class RewritesHistory(UserError):
    """A rendering does not extend the previous one."""


def _check_extends(before: str, after: str, turn: int) -> None:
    if not after.startswith(before):
        at = next(k for k, (a, b) in enumerate(zip(before + "\0", after + "\0")) if a != b)
        raise RewritesHistory(
            f"the model's chat template cannot be split into trained turns: at turn {turn} the rendering "
            f"reads {after[at:at + 40]!r} where the previous one read {before[at:at + 40]!r} (a completion must extend "
            "its prompt; a template that always appends the generation prompt cannot be trained)"
        )


TEXT_ROLES = ("user", "system", "tool")  # messages whose text is text: control-token spellings in it stay characters
PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")


def _renderings(text: str) -> tuple[str, ...]:
    """What a template may render for `text`: as written, trimmed, or escaped as a JSON string (`tojson`, whose
    transformers version keeps non-ASCII characters unless asked for `ensure_ascii`)."""
    return (text, text.strip(), text.rstrip(), text.lstrip(), json.dumps(text, ensure_ascii=False)[1:-1], json.dumps(text)[1:-1])


class _ControlSpellings:
    """The spellings of a tokenizer's special tokens: what parsing markup for control tokens matches and parsing text
    does not (an added token that is not special is matched in text too)."""

    def __init__(self, tokenizer):
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        spellings = {getattr(t, "content", t) for t in added.values() if getattr(t, "special", True)}
        spellings |= set(getattr(tokenizer, "all_special_tokens", ()))
        spellings = sorted((s for s in spellings if isinstance(s, str) and s), key=len, reverse=True)
        self._any = re.compile("|".join(map(re.escape, spellings))) if spellings else None
        self._heads = {s[:k] for s in spellings for k in range(1, len(s))}  # proper prefixes
        self._tails = {s[k:] for s in spellings for k in range(1, len(s))}  # proper suffixes
        self._longest = len(spellings[0]) if spellings else 0

    def touches(self, text: str) -> bool:
        """Whether `text` holds a spelling, or could complete one with the characters rendered before or after it."""
        if self._any is None:
            return False
        if self._any.search(text):
            return True
        reach = min(len(text), self._longest - 1)
        return any(text[-k:] in self._heads or text[:k] in self._tails for k in range(1, reach + 1))


# the last `{% endfor %}` and one output expression after it; the expression holds no other tag (the released
# template has earlier endfors, and a lazy `.*?` from the first of them swallowed the whole message loop)
_TRAILING_OUTPUT = re.compile(r"(\{%-?\s*endfor\s*-?%\})(\s*)(\{\{(?:(?!\{[{%#]).)*?\}\})(\s*)$", re.S)


def honour_generation_flag(tokenizer) -> str | None:
    """The tokenizer's template, with a generation prompt it appends unconditionally made conditional.

    ERNIE-4.5-21B-A3B-Thinking's template ends its message loop with `{{- "<|im_start|>assistant\n<think>\n" }}`
    outside any `if add_generation_prompt`, so every rendering ends as a prompt and no rendering of a finished
    conversation extends as training needs. Wrapping that trailing expression in the flag (as Unsloth's
    tokenizer fixes do) changes nothing for inference, which always asks for the prompt; this is checked by
    rendering. Any other template is returned unchanged.
    """
    template = tokenizer.chat_template
    probe = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]

    def render(text, flag):
        return tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=flag, chat_template=text)

    match = _TRAILING_OUTPUT.search(template or "")
    try:
        if not match or render(template, False) != render(template, True):
            return template
        fixed = template[: match.start(3)] + "{%- if add_generation_prompt %}" + match.group(3) + "{%- endif %}" + match.group(4)
        if render(fixed, True) == render(template, True) and render(fixed, False) != render(template, False):
            return fixed
    except Exception:  # a template that cannot render this probe is left for pieces() to report
        pass
    return template


def function_tools(tools: list[dict] | None) -> list[dict]:
    """Tools in the shape chat templates read, `{"type": "function", "function": schema}`: a bare schema (glaive's
    `{"name", "parameters"}`) is wrapped, as transformers wraps a Python function. The released Thinking template
    renders `tool.function` and fails on a bare one."""
    return [t if isinstance(t, dict) and isinstance(t.get("function"), dict) else {"type": "function", "function": t}
            for t in tools or []]


def _chat_messages(turn: Turn) -> tuple[dict, dict]:
    """A turn as chat-template messages: the user (or tool result) message and the assistant's answer."""
    answer = {"role": "assistant", "content": turn.assistant}
    if turn.tool_calls:
        answer["tool_calls"] = turn.tool_calls
    return {"role": "tool" if turn.tool_result else "user", "content": turn.user}, answer


def template_for(tokenizer) -> ErnieTemplate | ModelTemplate:
    """ERNIE's template unless the tokenizer ships a different one (decided by rendering, not by string compare)."""
    own = getattr(tokenizer, "chat_template", None)
    try:
        ernie = ErnieTemplate(tokenizer)
    except ValueError:
        if not own:
            raise
        return ModelTemplate(tokenizer)
    if not own:
        return ernie
    probe = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]
    expected = f"{BOS}S\nUser: Q1\nAssistant: A1{EOT}User: Q2\nAssistant: "
    for messages, want in ((probe, expected), (probe[1:], expected.replace(f"{BOS}S\n", BOS))):
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:
            continue  # e.g. a template that rejects system messages: probe again without one
        return ernie if rendered == want else ModelTemplate(tokenizer)
    return ernie  # the template cannot be rendered at all (e.g. no jinja2); the control tokens are ERNIE's
