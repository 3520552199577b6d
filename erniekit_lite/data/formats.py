"""Normalise every supported record format to one `Conversation`. Only this module knows format names.

    erniekit  {"system"?, "src": [q1, q2], "tgt": [a1, a2], "label"?: [0, 1]}      label 0 = turn not trained
    alpaca    {"instruction", "input"?, "output", "system"?, "history"?: [[q, a], ...]}
    sharegpt  {"conversations": [{"from": "human"|"gpt"|"function_call"|"observation"|"system"|..., "value"}],
               "system"?, "tools"?}
    messages  {"messages": [{"role", "content": str | [{"type": "text", "text"|"value"}], "tool_calls"?, "loss_weight"?}],
               "tools"?}

Tool traffic stays structured: a record's `tools` list, each assistant turn's `tool_calls` (after its text) and
turns whose prompt is a tool result. The chat template decides how they look (template.py): a model template with a
tool role renders them natively; ERNIE 4.5's released template has none, so there they become text (`with_tools`,
`with_calls` below).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from erniekit_lite.data.load import MAX_NESTING, Record, too_deep
from erniekit_lite.errors import DataError


@dataclass
class Turn:
    user: str
    assistant: str
    train: bool = True  # False: the response is context only (no loss)
    # functions the assistant calls after its text, as chat templates read them:
    # {"type": "function", "function": {"name", "arguments"}}
    tool_calls: list[dict] = field(default_factory=list)
    tool_result: bool = False  # `user` is the output of the previous turn's tool calls, not a person's message


@dataclass
class Conversation:
    turns: list[Turn]
    system: str | None = None
    tools: list[dict] = field(default_factory=list)  # function schemas the record offers the model


def with_tools(system: str | None, tools: list[dict]) -> str | None:
    """ERNIE 4.5's template has no tool slot: the tool list follows the system prompt as JSON."""
    if not tools:
        return system
    text = "Tools: " + json.dumps(tools, ensure_ascii=False)
    return f"{system}\n\n{text}" if system else text


def with_calls(text: str, tool_calls: list[dict]) -> str:
    """ERNIE 4.5's template has no tool-call slot: an assistant's calls follow its text as a JSON list."""
    if not tool_calls:
        return text
    calls = json.dumps(tool_calls, ensure_ascii=False)
    return f"{text}\n{calls}" if text else calls


def _chat_format(data: dict) -> str | None:
    """The conversation format these keys name (SFT records, and KTO's labelled ones), or None."""
    if "src" in data and "tgt" in data:
        return "erniekit"
    if "conversations" in data:
        return "sharegpt"
    if "messages" in data:
        return "messages"
    if "instruction" in data or "output" in data:
        return "alpaca"
    return None


def detect_format(record: Record) -> str:
    data = record.fields()
    fmt = _chat_format(data)
    if fmt is not None:
        return fmt
    keys = ", ".join(sorted(data)) or "none"
    raise record.error(
        f"cannot tell the format from the keys ({keys}); expected src/tgt (erniekit), instruction/output (alpaca), "
        "conversations (sharegpt) or messages; or set format: in the recipe"
    )


def to_conversation(record: Record, fmt: str, default_system: str | None = None) -> Conversation:
    record.fields()  # a JSON object, or the one-line error
    conv = _PARSERS[fmt](record)
    if conv.system is None:
        conv.system = default_system
    if not conv.turns:
        raise record.error("no user/assistant turn to train on")
    return conv


def _erniekit(record: Record) -> Conversation:
    d = record.data
    src, tgt = _str_list(record, "src"), _str_list(record, "tgt")
    if len(src) != len(tgt):
        raise record.error(f"'src' has {len(src)} turns but 'tgt' has {len(tgt)}; expected one response per prompt")
    labels = d.get("label")
    if labels is None:
        labels = [1] * len(src)
    elif not isinstance(labels, list) or len(labels) != len(src) or any(v not in (0, 1) for v in labels):
        raise record.error(f"'label' must be a list of 0/1, one per turn ({len(src)}), got {labels!r}")
    return Conversation([Turn(q, a, bool(l)) for q, a, l in zip(src, tgt, labels)], _opt_str(record, "system"))


def _alpaca(record: Record) -> Conversation:
    d = record.data
    instruction = _req_str(record, "instruction")
    extra = _opt_str(record, "input")
    output = _req_str(record, "output")
    turns = []
    history = d.get("history") or []
    if not isinstance(history, list) or not all(isinstance(h, list) and len(h) == 2 for h in history):
        raise record.error("'history' must be a list of [prompt, response] pairs")
    for q, a in history:
        if not isinstance(q, str) or not isinstance(a, str):
            raise record.error("'history' must hold strings")
        turns.append(Turn(q, a))
    user = f"{instruction}\n{extra}" if extra else instruction
    turns.append(Turn(user, output))
    return Conversation(turns, _opt_str(record, "system"))


@dataclass
class _Message:
    role: str  # system | user | tool | assistant
    text: str
    tool_calls: list[dict] = field(default_factory=list)
    train: bool = True


_SHAREGPT_ROLES = {
    "human": "user", "user": "user", "observation": "tool", "tool": "tool", "function": "tool",
    "gpt": "assistant", "assistant": "assistant", "function_call": "assistant", "bot": "assistant",
    "system": "system",
}
_MESSAGE_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool", "function": "tool", "observation": "tool"}


def _sharegpt(record: Record) -> Conversation:
    return _from_messages(record, _sharegpt_messages(record), _opt_str(record, "system"), _tools(record))


def _sharegpt_messages(record: Record) -> list[_Message]:
    """The `conversations` entries as messages; a function_call's value is the call as JSON, {"name", "arguments"}."""
    conversations = record.data["conversations"]
    if not isinstance(conversations, list):
        raise record.error("'conversations' must be a list of {from, value}")
    messages = []
    for i, m in enumerate(conversations):
        if not isinstance(m, dict) or "from" not in m or "value" not in m:
            raise record.error(f"conversations[{i}] must be an object with 'from' and 'value'")
        role = _role(_SHAREGPT_ROLES, m["from"])
        if role is None:
            raise record.error(f"conversations[{i}]: unknown role 'from: {m['from']}'; expected one of {', '.join(_SHAREGPT_ROLES)}")
        where = f"conversations[{i}].value"
        text = _text(record, m["value"], where)
        if m["from"] == "function_call":  # the value is the call as JSON
            messages.append(_Message(role, "", _tool_calls(record, _json(record, text, where), where)))
        else:
            messages.append(_Message(role, text))
    return messages


def _role(roles: dict[str, str], name: Any) -> str | None:
    # found by fuzzing: a list or object as the role name was a TypeError (unhashable), not an unknown-role DataError
    return roles.get(name) if isinstance(name, str) else None


def _messages(record: Record) -> Conversation:
    return _from_messages(record, _role_messages(record, record.data["messages"], "messages"), None, _tools(record))


def _role_messages(record: Record, raw: Any, key: str) -> list[_Message]:
    """OpenAI-style messages (`messages`, or a TRL prompt): roles tool/function/observation are tool results."""
    if not isinstance(raw, list):
        raise record.error(f"'{key}' must be a list of {{role, content}}")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or "role" not in m or ("content" not in m and "tool_calls" not in m):
            raise record.error(f"{key}[{i}] must be an object with 'role' and 'content'")
        role = _role(_MESSAGE_ROLES, m["role"])
        if role is None:
            raise record.error(f"{key}[{i}]: unknown role '{m['role']}'; expected system, user, assistant or tool")
        content = m.get("content")
        text = "" if content is None else _text(record, content, f"{key}[{i}].content")
        weight = m.get("loss_weight", 1.0)
        trained = not (isinstance(weight, (int, float)) and weight == 0)
        messages.append(_Message(role, text, _tool_calls(record, m.get("tool_calls"), f"{key}[{i}].tool_calls"), trained))
    return messages


def _from_messages(record: Record, messages: list[_Message], system: str | None, tools: list[dict]) -> Conversation:
    """Fold messages into turns: a run of user/tool messages, then the run of assistant messages answering it.
    Texts within a run are joined with newlines; the assistant's tool calls are kept in order."""
    runs: list[list[_Message]] = []
    for m in messages:
        if m.role == "system":
            system = m.text if system is None else f"{system}\n{m.text}"
        elif runs and (runs[-1][0].role == "assistant") == (m.role == "assistant"):
            runs[-1].append(m)
        else:
            runs.append([m])
    if runs and runs[0][0].role == "assistant":
        raise record.error("the conversation must start with a user turn (after any system message)")
    if runs and runs[-1][0].role != "assistant":
        runs.pop()  # a trailing prompt without a response teaches nothing
    turns = [
        Turn(
            _join(prompt),
            _join(answer),
            all(m.train for m in answer),
            [call for m in answer for call in m.tool_calls],
            all(m.role == "tool" for m in prompt),
        )
        for prompt, answer in zip(runs[::2], runs[1::2])
    ]
    return Conversation(turns, system, tools)


def _join(run: list[_Message]) -> str:
    return "\n".join(m.text for m in run if m.text)


def _tool_calls(record: Record, value: Any, where: str) -> list[dict]:
    """Tool calls as {"type": "function", "function": {"name", "arguments"?, ...}}; a bare {"name", "arguments"?} is
    wrapped, other keys (e.g. an OpenAI call id) are kept."""
    if value is None:
        return []
    calls = value if isinstance(value, list) else [value]
    out = []
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise record.error(f"{where}: a tool call must hold 'name' and 'arguments', at the top or under 'function', got {_short(call)}")
        out.append(call if "function" in call else {"type": "function", "function": call})
    return out


def _tools(record: Record) -> list[dict]:
    """A record's function schemas: a list, or a JSON string of one (glaive writes "[]" for none)."""
    tools = record.data.get("tools")
    if isinstance(tools, str):
        tools = _json(record, tools, "tools") if tools.strip() else None
    if not tools:
        return []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise record.error(f"field 'tools' must be a list of function schemas (objects), got {_short(tools)}")
    return tools


def _json(record: Record, text: str, where: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise record.error(f"{where}: expected JSON ({e.msg} at character {e.pos})") from None
    except RecursionError:  # found by fuzzing: as for whole records (load.py), deep JSON in a field is an error
        raise record.error(f"{where}: JSON nested more than {MAX_NESTING} levels deep") from None
    if too_deep(value, text):
        raise record.error(f"{where}: JSON nested more than {MAX_NESTING} levels deep")
    return value


def _text(record: Record, value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # multimodal-style content parts; only text is supported
        parts = []
        for part in value:
            if isinstance(part, dict) and part.get("type", "text") == "text":
                text = part.get("text", part.get("value"))
                if isinstance(text, str):
                    parts.append(text)
                    continue
            if isinstance(part, (dict, list)) and "type" not in part:
                parts.append(json.dumps(part, ensure_ascii=False))  # e.g. a tool result object
                continue
            raise record.error(f"{where}: unsupported content part {str(part)[:60]!r}; only text is supported")
        return "".join(parts)
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    raise record.error(f"{where}: expected a string, got {type(value).__name__}")


def _req_str(record: Record, key: str) -> str:
    if key not in record.data:
        raise record.error(f"missing field '{key}'")
    value = record.data[key]
    if not isinstance(value, str):
        raise record.error(f"field '{key}' must be a string, got {type(value).__name__}")
    return value


def _opt_str(record: Record, key: str) -> str | None:
    value = record.data.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise record.error(f"field '{key}' must be a string, got {type(value).__name__}")
    return value


def _str_list(record: Record, key: str) -> list[str]:
    if key not in record.data:
        raise record.error(f"missing field '{key}'")
    value = record.data[key]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise record.error(f"field '{key}' must be a list of strings")
    return value


_PARSERS = {"erniekit": _erniekit, "alpaca": _alpaca, "sharegpt": _sharegpt, "messages": _messages}


def check_format(record: Record, fmt: str) -> None:
    """Raise if an explicitly chosen format cannot read this record (clearer than a missing-key error)."""
    required = {"erniekit": ("src", "tgt"), "alpaca": ("instruction", "output"), "sharegpt": ("conversations",), "messages": ("messages",)}
    record.fields()  # a JSON object, or the one-line error
    if fmt not in required:  # found by fuzzing: `format: trl` in an SFT recipe (the recipe allows it) was a KeyError
        raise record.error(f"format '{fmt}' is not an SFT format (trl is for preference data); expected {', '.join(required)}")
    missing = [k for k in required[fmt] if k not in record.data]
    if missing:
        raise record.error(f"missing field '{missing[0]}' ({fmt} format)")


# ---------------------------------------------------------------------------------------------------------------
# Preference (DPO) records: one prompt (with earlier turns as context), a chosen and a rejected response.
#
#     erniekit  {"system"?, "src": [q1, .., qn], "tgt": [a1, .., a(n-1)], "response": [[a], [b]], "sort": [s_a, s_b]}
#               higher sort = chosen
#     sharegpt  {"conversations": [{"from", "value"}, .., user prompt], "chosen": {"from", "value"}, "rejected": ..,
#                "system"?, "tools"?}
#     trl       {"prompt": str, "chosen": str, "rejected": str}, or conversational: "prompt" a list of {"role", "content"}
#               ending with a user message, "chosen"/"rejected" lists holding one assistant message
#     alpaca    {"question" | "instruction" + "input"?, "chosen", "rejected", "system"?, "history"?: [[q, a], ...]}
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Preference:
    history: list[Turn]  # earlier turns of the conversation, context only (Turn.train=False)
    prompt: str  # the last user message
    chosen: str
    rejected: str
    system: str | None = None


class Skip(Exception):
    """A well-formed record that cannot be trained; str(exc) is a short reason used as a counter key,
    e.g. "identical chosen and rejected", "empty response", "tied sort"."""


PREFERENCE_FORMATS = ("erniekit", "sharegpt", "trl", "alpaca")


def detect_preference_format(record: Record) -> str:
    data = record.fields()
    if "src" in data and "response" in data:
        return "erniekit"
    if "conversations" in data and "chosen" in data:
        return "sharegpt"
    if "prompt" in data and "chosen" in data:
        return "trl"
    if ("question" in data or "instruction" in data) and "chosen" in data:
        return "alpaca"
    keys = ", ".join(sorted(data)) or "none"
    hint = ""
    if "chosen" in data and "rejected" in data:
        hint = "; chosen/rejected without a prompt (TRL's implicit-prompt form) is not supported: move the prompt to 'prompt'"
    raise record.error(
        f"cannot tell the preference format from the keys ({keys}); expected src/response/sort (erniekit), "
        f"conversations/chosen/rejected (sharegpt), prompt/chosen/rejected (trl) or "
        f"question|instruction/chosen/rejected (alpaca); or set format: in the recipe{hint}"
    )


def to_preference(record: Record, fmt: str, default_system: str | None = None) -> Preference:
    """One preference pair. Raises DataError (with file:line) for a malformed record, Skip for an untrainable one."""
    record.fields()  # a JSON object, or the one-line error
    parser = _PREFERENCE_PARSERS.get(fmt)
    if parser is None:
        raise record.error(f"unknown preference format '{fmt}'; expected one of {', '.join(PREFERENCE_FORMATS)}")
    pref = parser(record)
    if pref.system is None:
        pref.system = default_system
    if fmt in ("sharegpt", "trl"):  # after the default system, so a recipe's system prompt is kept
        pref.system = with_tools(pref.system, _tools(record))
    if not pref.chosen.strip() or not pref.rejected.strip():
        raise Skip("empty response")
    if pref.chosen.strip() == pref.rejected.strip():  # differing only in surrounding whitespace is no preference
        raise Skip("identical chosen and rejected")
    return pref


def _erniekit_pref(record: Record) -> Preference:
    d = record.data
    src = _str_list(record, "src")
    tgt = _str_list(record, "tgt") if d.get("tgt") is not None else []
    if not src:
        raise record.error("field 'src' is empty; expected at least the prompt")
    if len(tgt) != len(src) - 1:
        raise record.error(
            f"'src' has {len(src)} turns but 'tgt' has {len(tgt)}; expected one response per earlier prompt "
            "(len(tgt) = len(src) - 1: the last src is the prompt answered by 'response')"
        )
    response = _require(record, "response")
    if not isinstance(response, list) or len(response) != 2:
        raise record.error(f"field 'response' must be a list of two responses [[a], [b]], got {_short(response)}")
    texts = []
    for i, r in enumerate(response):
        if isinstance(r, list) and len(r) == 1:
            r = r[0]
        if not isinstance(r, str):
            raise record.error(f"response[{i}] must be a list holding one string (or a string), got {_short(r)}")
        texts.append(r)
    sort = _require(record, "sort")
    if (
        not isinstance(sort, list)
        or len(sort) != 2
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in sort)
        or any(isinstance(v, float) and math.isnan(v) for v in sort)  # found by fuzzing: NaN silently chose a side
    ):
        raise record.error(f"field 'sort' must be a list of two numbers, one per response, got {_short(sort)}")
    if sort[0] == sort[1]:
        raise Skip("tied sort")
    chosen, rejected = (texts[0], texts[1]) if sort[0] > sort[1] else (texts[1], texts[0])
    history = [Turn(q, a, train=False) for q, a in zip(src[:-1], tgt)]
    return Preference(history, src[-1], chosen, rejected, _opt_str(record, "system"))


def _sharegpt_pref(record: Record) -> Preference:
    _require(record, "conversations")
    messages = _sharegpt_messages(record)
    system, history, prompt = _split_prompt(record, messages, _opt_str(record, "system"), "conversations")
    chosen = _sharegpt_response(record, "chosen")
    rejected = _sharegpt_response(record, "rejected")
    return Preference(history, prompt, chosen, rejected, system)


def _sharegpt_response(record: Record, key: str) -> str:
    value = _require(record, key)
    if isinstance(value, str):
        return value
    if not isinstance(value, dict) or "value" not in value:
        raise record.error(f"field '{key}' must be an object with 'from' and 'value', got {_short(value)}")
    role = value.get("from", "gpt")
    if _role(_SHAREGPT_ROLES, role) != "assistant":
        raise record.error(f"field '{key}': the response must come from the assistant (gpt), got 'from: {role}'")
    text = _text(record, value["value"], f"{key}.value")
    if role == "function_call":
        return with_calls("", _tool_calls(record, _json(record, text, f"{key}.value"), f"{key}.value"))
    return text


def _trl_pref(record: Record) -> Preference:
    prompt = _require(record, "prompt")
    system = _opt_str(record, "system")
    if isinstance(prompt, str):
        history: list[Turn] = []
    elif isinstance(prompt, list):
        system, history, prompt = _split_prompt(record, _role_messages(record, prompt, "prompt"), system, "prompt")
    else:
        raise record.error(f"field 'prompt' must be a string or a list of {{role, content}} messages, got {type(prompt).__name__}")
    return Preference(history, prompt, _trl_response(record, "chosen"), _trl_response(record, "rejected"), system)


def _trl_response(record: Record, key: str) -> str:
    value = _require(record, key)
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise record.error(f"field '{key}' must be a string or a list with one assistant message, got {type(value).__name__}")
    messages = _role_messages(record, value, key)
    if len(messages) != 1 or messages[0].role != "assistant":
        roles = ", ".join(m.role for m in messages) or "none"
        raise record.error(f"field '{key}' must hold exactly one assistant message, got roles: {roles}")
    return with_calls(messages[0].text, messages[0].tool_calls)


def _split_prompt(
    record: Record, messages: list[_Message], system: str | None, key: str
) -> tuple[str | None, list[Turn], str]:
    """Messages ending with the prompt -> (system, context turns, prompt), as ERNIE 4.5 text: tool results are user
    turns and tool calls follow the assistant's text. Consecutive messages of one side are joined, as for SFT."""
    merged: list[list[str]] = []
    for m in messages:
        role = {"tool": "user"}.get(m.role, m.role)
        text = with_calls(m.text, m.tool_calls)
        if role == "system":
            system = text if system is None else f"{system}\n{text}"
        elif merged and merged[-1][0] == role:
            merged[-1][1] += "\n" + text
        else:
            merged.append([role, text])
    if not merged:
        raise record.error(f"'{key}' has no user message; expected the prompt as its last message")
    if merged[0][0] != "user":
        raise record.error(f"'{key}' must start with a user message (after any system message)")
    if merged[-1][0] != "user":
        raise record.error(f"'{key}' must end with a user message (the prompt), not an assistant one")
    history = [Turn(u[1], a[1], train=False) for u, a in zip(merged[:-1:2], merged[1::2])]
    return system, history, merged[-1][1]


def _alpaca_pref(record: Record) -> Preference:
    d = record.data
    if "instruction" in d:
        instruction = _req_str(record, "instruction")
        extra = _opt_str(record, "input")
        prompt = f"{instruction}\n{extra}" if extra else instruction
    else:
        prompt = _req_str(record, "question")
    chosen, rejected = _req_str(record, "chosen"), _req_str(record, "rejected")
    history = d.get("history") or []
    if not isinstance(history, list) or not all(isinstance(h, list) and len(h) == 2 for h in history):
        raise record.error("'history' must be a list of [prompt, response] pairs")
    turns = []
    for q, a in history:
        if not isinstance(q, str) or not isinstance(a, str):
            raise record.error("'history' must hold strings")
        turns.append(Turn(q, a, train=False))
    return Preference(turns, prompt, chosen, rejected, _opt_str(record, "system"))


def _require(record: Record, key: str) -> Any:
    if record.data.get(key) is None:  # absent, or null (an empty CSV cell)
        raise record.error(f"missing field '{key}'")
    return record.data[key]


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_PREFERENCE_PARSERS = {"erniekit": _erniekit_pref, "sharegpt": _sharegpt_pref, "trl": _trl_pref, "alpaca": _alpaca_pref}


# ---------------------------------------------------------------------------------------------------------------
# Unpaired feedback (KTO) records: a prompt (earlier turns as context) and one completion, labelled desirable (true)
# or undesirable (false) in `label` or `kto_tag` (LLaMA-Factory's name). The completion is the last assistant turn.
#
#     trl       {"prompt": str | [{"role", "content"}, .., user message], "completion": str | [one assistant message],
#                "label": bool, "system"?, "tools"?}                                       (TRL's unpaired preference)
#     alpaca    {"instruction", "input"?, "output", "label" | "kto_tag", "system"?, "history"?: [[q, a], ...]}
#     sharegpt  {"conversations": [{"from", "value"}, .., user, assistant], "label" | "kto_tag", "system"?, "tools"?}
#     messages  {"messages": [{"role", "content"}, .., user, assistant], "label" | "kto_tag", "tools"?}
#     erniekit  {"system"?, "src": [q1, .., qn], "tgt": [a1, .., an], "label" | "kto_tag": bool}   an answers qn
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Feedback:
    history: list[Turn]  # earlier turns of the conversation, context only (Turn.train=False)
    prompt: str  # the last user message
    completion: str
    desirable: bool
    system: str | None = None


FEEDBACK_FORMATS = ("trl", "alpaca", "sharegpt", "messages", "erniekit")
FEEDBACK_LABELS = ("label", "kto_tag")


def detect_feedback_format(record: Record) -> str:
    data = record.fields()
    if "chosen" in data or "rejected" in data or ("response" in data and "sort" in data):
        raise record.error("a preference pair (chosen and rejected responses); method kto takes one completion per record "
                           "with a label: write each response as its own record, label true for the chosen one and false "
                           "for the rejected one (or train the pairs with method dpo)")
    if "prompt" in data and "completion" in data:
        return "trl"
    fmt = _chat_format(data)
    if fmt is not None:
        return fmt
    keys = ", ".join(sorted(data)) or "none"
    raise record.error(
        f"cannot tell the feedback format from the keys ({keys}); expected prompt/completion/label (trl), src/tgt/label "
        "(erniekit), conversations/label (sharegpt), messages/label or instruction/output/label (alpaca; kto_tag also "
        "names the label); or set format: in the recipe"
    )


def to_feedback(record: Record, fmt: str, default_system: str | None = None) -> Feedback:
    """One labelled completion. Raises DataError (with file:line) for a malformed record, Skip for an untrainable one."""
    record.fields()  # a JSON object, or the one-line error
    parser = _FEEDBACK_PARSERS.get(fmt)
    if parser is None:
        raise record.error(f"unknown feedback format '{fmt}'; expected one of {', '.join(FEEDBACK_FORMATS)}")
    desirable = _feedback_label(record)
    system, history, prompt, completion = parser(record)
    if system is None:
        system = default_system
    if fmt in ("sharegpt", "trl", "messages"):  # after the default system, so a recipe's system prompt is kept
        system = with_tools(system, _tools(record))
    if not completion.strip():
        raise Skip("empty completion")
    return Feedback(history, prompt, completion, desirable, system)


def _feedback_label(record: Record) -> bool:
    """`label` or `kto_tag`: true or false (in a CSV cell, the text true or false)."""
    given = [k for k in FEEDBACK_LABELS if record.data.get(k) is not None]
    if not given:
        raise record.error("missing field 'label' (or 'kto_tag'): true for a desirable completion, false for an undesirable one")
    values = [record.data[k] for k in given]
    if isinstance(values[0], str) and values[0].strip().lower() in ("true", "false"):  # CSV cells are text
        values = [v.strip().lower() == "true" if isinstance(v, str) else v for v in values]
    key, value = given[0], values[0]
    if isinstance(value, list):
        raise record.error(f"field '{key}' is a list ({_short(value)}); a KTO label is one true (desirable) or false "
                           "(undesirable) for the completion (ERNIEKit's SFT 'label' is a 0/1 list marking trained turns, "
                           "which method kto does not read)")
    if not isinstance(value, bool):
        raise record.error(f"field '{key}' must be true (desirable) or false (undesirable), got {_short(value)}")
    if len(values) == 2 and values[1] != value:
        raise record.error("fields 'label' and 'kto_tag' disagree; give one of them")
    return value


def _trl_feedback(record: Record) -> tuple:
    prompt = _require(record, "prompt")
    system = _opt_str(record, "system")
    if isinstance(prompt, str):
        history: list[Turn] = []
    elif isinstance(prompt, list):
        system, history, prompt = _split_prompt(record, _role_messages(record, prompt, "prompt"), system, "prompt")
    else:
        raise record.error(f"field 'prompt' must be a string or a list of {{role, content}} messages, got {type(prompt).__name__}")
    return system, history, prompt, _trl_response(record, "completion")


def _alpaca_feedback(record: Record) -> tuple:
    conv = _alpaca(record)  # the history is context here, not trained
    history = [Turn(t.user, t.assistant, False) for t in conv.turns[:-1]]
    return conv.system, history, conv.turns[-1].user, conv.turns[-1].assistant


def _erniekit_feedback(record: Record) -> tuple:
    src, tgt = _str_list(record, "src"), _str_list(record, "tgt")
    if not src or len(src) != len(tgt):
        raise record.error(f"'src' has {len(src)} turns but 'tgt' has {len(tgt)}; expected one response per prompt, the "
                           "last 'tgt' being the completion that 'label' judges")
    history = [Turn(q, a, train=False) for q, a in zip(src[:-1], tgt[:-1])]
    return _opt_str(record, "system"), history, src[-1], tgt[-1]


def _sharegpt_feedback(record: Record) -> tuple:
    _require(record, "conversations")
    return _completion_last(record, _sharegpt_messages(record), _opt_str(record, "system"), "conversations")


def _messages_feedback(record: Record) -> tuple:
    return _completion_last(record, _role_messages(record, _require(record, "messages"), "messages"), None, "messages")


def _completion_last(record: Record, messages: list[_Message], system: str | None, key: str) -> tuple:
    """Messages ending with the assistant's completion (consecutive assistant messages joined, tool calls after
    their text) -> (system, context turns, prompt, completion)."""
    end = len(messages)
    while end and messages[end - 1].role == "assistant":
        end -= 1
    if end == len(messages):
        raise record.error(f"'{key}' must end with the assistant's completion, the message the label judges")
    completion = "\n".join(with_calls(m.text, m.tool_calls) for m in messages[end:])
    system, history, prompt = _split_prompt(record, messages[:end], system, key)
    return system, history, prompt, completion


_FEEDBACK_PARSERS = {"trl": _trl_feedback, "alpaca": _alpaca_feedback, "sharegpt": _sharegpt_feedback,
                     "messages": _messages_feedback, "erniekit": _erniekit_feedback}


__all__ = [
    "Conversation", "Turn", "with_tools", "with_calls", "detect_format", "to_conversation", "check_format", "DataError",
    "Preference", "Skip", "PREFERENCE_FORMATS", "detect_preference_format", "to_preference",
    "Feedback", "FEEDBACK_FORMATS", "detect_feedback_format", "to_feedback",
]
