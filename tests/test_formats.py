"""Record formats -> Conversation: erniekit, alpaca, sharegpt, messages; detection, checks, errors, and the real
demo files in ../shared/data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import SHARED_HOW, needs

from erniekit_lite.data.formats import Conversation, Turn, check_format, detect_format, to_conversation, with_calls, with_tools
from erniekit_lite.data.load import Record, read_records
from erniekit_lite.errors import DataError

DATA_DIR = Path(os.environ.get("ERNIEKIT_SHARED", Path(__file__).resolve().parents[2] / "shared")) / "data"
needs_data = needs(DATA_DIR.is_dir(), f"the shared demo data at {DATA_DIR}", SHARED_HOW)


def rec(data, path="d.jsonl", line=7) -> Record:
    return Record(data, path, line)


def conv_of(data, fmt=None, default_system=None) -> Conversation:
    r = rec(data)
    return to_conversation(r, fmt or detect_format(r), default_system)


# ---------------------------------------------------------------------------------------------------------------
# detection and explicit-format checks
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, fmt",
    [
        ({"src": ["q"], "tgt": ["a"]}, "erniekit"),
        ({"src": "q", "tgt": "a", "system": "s"}, "erniekit"),
        ({"instruction": "q", "output": "a"}, "alpaca"),
        ({"instruction": "q", "input": "", "output": "a", "history": []}, "alpaca"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}, "sharegpt"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "messages"),
    ],
)
def test_detect_format(data, fmt):
    assert detect_format(rec(data)) == fmt


def test_detect_format_unknown_keys_names_them_and_the_place():
    with pytest.raises(DataError) as e:
        detect_format(rec({"question": "q", "answer": "a"}, "x/data.jsonl", 4))
    msg = str(e.value)
    assert msg.startswith("x/data.jsonl:4: cannot tell the format from the keys (answer, question)")
    assert "src/tgt" in msg and "instruction/output" in msg and "conversations" in msg and "messages" in msg
    assert e.value.path == "x/data.jsonl" and e.value.line == 4
    with pytest.raises(DataError, match=r"d.jsonl:7: cannot tell the format from the keys \(none\)"):
        detect_format(rec({}))


@pytest.mark.parametrize("data, kind", [([1, 2], "list"), ("text", "str"), (3, "int"), (None, "NoneType")])
def test_record_that_is_not_an_object(data, kind):
    for call in (lambda r: detect_format(r), lambda r: to_conversation(r, "alpaca"), lambda r: check_format(r, "erniekit")):
        with pytest.raises(DataError, match=rf"^d.jsonl:7: expected a JSON object per record, got {kind}$"):
            call(rec(data))


@pytest.mark.parametrize(
    "fmt, data, missing",
    [
        ("alpaca", {"instruction": "q"}, "output"),
        ("alpaca", {"output": "a"}, "instruction"),
        ("erniekit", {"src": ["q"]}, "tgt"),
        ("erniekit", {"instruction": "q", "output": "a"}, "src"),
        ("sharegpt", {"messages": []}, "conversations"),
        ("messages", {"conversations": []}, "messages"),
    ],
)
def test_check_format_missing_field(fmt, data, missing):
    with pytest.raises(DataError, match=rf"^d.jsonl:7: missing field '{missing}' \({fmt} format\)$"):
        check_format(rec(data), fmt)


def test_check_format_accepts_matching_record():
    check_format(rec({"src": ["q"], "tgt": ["a"]}), "erniekit")
    check_format(rec({"instruction": "q", "output": "a"}), "alpaca")


# ---------------------------------------------------------------------------------------------------------------
# erniekit
# ---------------------------------------------------------------------------------------------------------------


def test_erniekit_multi_turn_with_label_and_system():
    conv = conv_of({"system": "S", "src": ["q1", "q2", "q3"], "tgt": ["a1", "a2", "a3"], "label": [0, 1, 0]})
    assert conv.system == "S"
    assert conv.turns == [Turn("q1", "a1", False), Turn("q2", "a2", True), Turn("q3", "a3", False)]


def test_erniekit_defaults_and_string_fields():
    conv = conv_of({"src": "q", "tgt": "a"})
    assert conv.turns == [Turn("q", "a", True)] and conv.system is None
    assert conv_of({"src": ["q"], "tgt": ["a"], "system": ""}).system is None  # empty system = none


def test_erniekit_src_tgt_length_mismatch():
    with pytest.raises(DataError, match=r"^d.jsonl:7: 'src' has 2 turns but 'tgt' has 1; expected one response per prompt$"):
        conv_of({"src": ["q1", "q2"], "tgt": ["a1"]})


@pytest.mark.parametrize("label", [[1], [1, 2], "1,1", [1, None]])
def test_erniekit_bad_label(label):
    with pytest.raises(DataError, match=r"^d.jsonl:7: 'label' must be a list of 0/1, one per turn \(2\)"):
        conv_of({"src": ["q1", "q2"], "tgt": ["a1", "a2"], "label": label})


def test_erniekit_bad_types_and_empty():
    with pytest.raises(DataError, match=r"^d.jsonl:7: field 'tgt' must be a list of strings$"):
        conv_of({"src": ["q"], "tgt": [1]})
    with pytest.raises(DataError, match=r"^d.jsonl:7: field 'system' must be a string, got list$"):
        conv_of({"src": ["q"], "tgt": ["a"], "system": ["s"]})
    with pytest.raises(DataError, match=r"^d.jsonl:7: no user/assistant turn to train on$"):
        conv_of({"src": [], "tgt": []})


# ---------------------------------------------------------------------------------------------------------------
# alpaca
# ---------------------------------------------------------------------------------------------------------------


def test_alpaca_joins_instruction_and_input():
    conv = conv_of({"instruction": "Translate.", "input": "Bonjour", "output": "Hello"})
    assert conv.turns == [Turn("Translate.\nBonjour", "Hello", True)]
    assert conv_of({"instruction": "Hi", "input": "", "output": "Hello"}).turns == [Turn("Hi", "Hello")]
    assert conv_of({"instruction": "Hi", "output": "Hello"}).turns == [Turn("Hi", "Hello")]


def test_alpaca_history_becomes_earlier_turns_and_system_is_kept():
    conv = conv_of(
        {"instruction": "q3", "input": "ctx", "output": "a3", "system": "Be brief.", "history": [["q1", "a1"], ["q2", "a2"]]}
    )
    assert conv.turns == [Turn("q1", "a1"), Turn("q2", "a2"), Turn("q3\nctx", "a3")]
    assert conv.system == "Be brief."


def test_alpaca_errors():
    with pytest.raises(DataError, match=r"^d.jsonl:7: missing field 'output'$"):
        conv_of({"instruction": "q"}, "alpaca")
    with pytest.raises(DataError, match=r"^d.jsonl:7: field 'output' must be a string, got int$"):
        conv_of({"instruction": "q", "output": 4})
    with pytest.raises(DataError, match=r"^d.jsonl:7: 'history' must be a list of \[prompt, response\] pairs$"):
        conv_of({"instruction": "q", "output": "a", "history": [["q1"]]})
    with pytest.raises(DataError, match=r"^d.jsonl:7: 'history' must hold strings$"):
        conv_of({"instruction": "q", "output": "a", "history": [["q1", 1]]})


def test_default_system_applies_only_when_record_has_none():
    assert conv_of({"instruction": "q", "output": "a"}, default_system="D").system == "D"
    assert conv_of({"instruction": "q", "output": "a", "system": "R"}, default_system="D").system == "R"


# ---------------------------------------------------------------------------------------------------------------
# sharegpt
# ---------------------------------------------------------------------------------------------------------------


WEATHER_CALL = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}


def test_sharegpt_roles_system_and_tool_turns():
    conv = conv_of(
        {
            "conversations": [
                {"from": "system", "value": "Sys."},
                {"from": "human", "value": "Weather?"},
                {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Paris"}}'},
                {"from": "observation", "value": '{"t": 20}'},
                {"from": "gpt", "value": "20 degrees."},
            ],
            "tools": '[{"name": "weather"}]',
        }
    )
    # the call is structured (wrapped as chat templates read it); the observation is a tool-result turn
    assert conv.turns == [
        Turn("Weather?", "", tool_calls=[WEATHER_CALL]),
        Turn('{"t": 20}', "20 degrees.", tool_result=True),
    ]
    assert conv.system == "Sys."
    assert conv.tools == [{"name": "weather"}]


def test_sharegpt_text_then_parallel_calls_join_in_one_answer():
    second = {"name": "time", "arguments": {}}
    conv = conv_of(
        {
            "conversations": [
                {"from": "human", "value": "Weather and time?"},
                {"from": "gpt", "value": "Checking."},
                {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Paris"}}'},
                {"from": "function_call", "value": json.dumps(second)},
                {"from": "observation", "value": "20"},
                {"from": "observation", "value": "noon"},
                {"from": "gpt", "value": "20 degrees at noon."},
            ]
        }
    )
    assert conv.turns == [
        Turn("Weather and time?", "Checking.", tool_calls=[WEATHER_CALL, {"type": "function", "function": second}]),
        Turn("20\nnoon", "20 degrees at noon.", tool_result=True),
    ]


def test_tool_result_joined_with_a_user_message_is_a_user_turn():
    conv = conv_of(
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [WEATHER_CALL]},
                {"role": "tool", "content": "20"},
                {"role": "user", "content": "and tomorrow?"},
                {"role": "assistant", "content": "a"},
            ]
        }
    )
    assert conv.turns[1] == Turn("20\nand tomorrow?", "a")  # tool_result only when every prompt message is a tool's


def test_sharegpt_system_key_merges_consecutive_and_drops_trailing_prompt():
    conv = conv_of(
        {
            "system": "Top.",
            "conversations": [
                {"from": "human", "value": "a"},
                {"from": "human", "value": "b"},
                {"from": "gpt", "value": "c"},
                {"from": "bot", "value": "d"},
                {"from": "user", "value": "unanswered"},
            ],
        }
    )
    assert conv.turns == [Turn("a\nb", "c\nd")]
    assert conv.system == "Top."


def test_sharegpt_empty_tools_and_tools_keep_default_system():
    data = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    for empty in ("[]", " [] ", "", [], None):
        conv = conv_of({**data, "tools": empty}, default_system="D")
        assert conv.tools == [] and conv.system == "D"
    conv = conv_of({**data, "tools": '[{"name": "f"}]'}, default_system="D")
    assert conv.tools == [{"name": "f"}] and conv.system == "D"


def test_with_tools_and_with_calls_are_erniekit_text():
    """ERNIE 4.5's template has no tool slots: the text both SFT (ErnieTemplate) and preference records use."""
    assert with_tools("D", [{"name": "f"}]) == 'D\n\nTools: [{"name": "f"}]'
    assert with_tools(None, [{"name": "f"}]) == 'Tools: [{"name": "f"}]'
    assert with_tools("D", []) == "D" and with_tools(None, []) is None
    call_text = '[{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]'
    assert with_calls("<think>ok</think>", [WEATHER_CALL]) == "<think>ok</think>\n" + call_text
    assert with_calls("", [WEATHER_CALL]) == call_text
    assert with_calls("plain", []) == "plain"


@pytest.mark.parametrize(
    "data, message",
    [
        ({"tools": "[{name: f}]"}, r"tools: expected JSON \(Expecting property name enclosed in double quotes at character 2\)$"),
        ({"tools": {"name": "f"}}, r"field 'tools' must be a list of function schemas \(objects\), got \{\"name\": \"f\"\}$"),
        ({"tools": ["f"]}, r"field 'tools' must be a list of function schemas \(objects\), got \[\"f\"\]$"),
    ],
)
def test_bad_tools(data, message):
    base = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    with pytest.raises(DataError, match=r"^d.jsonl:7: " + message):
        conv_of({**base, **data})


def test_bad_tool_calls():
    def sharegpt(value):
        return {"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": value}]}

    with pytest.raises(DataError, match=r"^d.jsonl:7: conversations\[1\].value: expected JSON \(Expecting value at character 0\)$"):
        conv_of(sharegpt("call weather"))
    with pytest.raises(DataError, match=r"^d.jsonl:7: conversations\[1\].value: a tool call must hold 'name' and 'arguments', at the top or under 'function', got \{\"arguments\": \{\}\}$"):
        conv_of(sharegpt('{"arguments": {}}'))
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": "f"}]}]}
    with pytest.raises(DataError, match=r'^d.jsonl:7: messages\[1\].tool_calls: a tool call must hold .* got \{"function": "f"\}$'):
        conv_of(bad)


def test_sharegpt_errors():
    with pytest.raises(DataError, match=r"^d.jsonl:7: conversations\[1\]: unknown role 'from: robot'; expected one of human, user"):
        conv_of({"conversations": [{"from": "human", "value": "q"}, {"from": "robot", "value": "a"}]})
    with pytest.raises(DataError, match=r"^d.jsonl:7: conversations\[0\] must be an object with 'from' and 'value'$"):
        conv_of({"conversations": [{"from": "human"}]})
    with pytest.raises(DataError, match=r"^d.jsonl:7: 'conversations' must be a list of \{from, value\}$"):
        conv_of({"conversations": "hi"})
    with pytest.raises(DataError, match=r"^d.jsonl:7: the conversation must start with a user turn"):
        conv_of({"conversations": [{"from": "gpt", "value": "hello"}, {"from": "human", "value": "q"}]})
    with pytest.raises(DataError, match=r"^d.jsonl:7: no user/assistant turn to train on$"):
        conv_of({"conversations": [{"from": "human", "value": "q"}]})
    with pytest.raises(DataError, match=r"^d.jsonl:7: conversations\[0\].value: expected a string, got int$"):
        conv_of({"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "a"}]})


# ---------------------------------------------------------------------------------------------------------------
# messages
# ---------------------------------------------------------------------------------------------------------------


def test_messages_loss_weight_zero_masks_assistant_turn():
    conv = conv_of(
        {
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": [{"type": "text", "value": "q1"}], "loss_weight": 0.0},
                {"role": "assistant", "content": [{"type": "text", "value": "a1"}], "loss_weight": 0.0},
                {"role": "user", "content": [{"type": "text", "text": "q2"}]},
                {"role": "assistant", "content": "a2", "loss_weight": 1.0},
                {"role": "user", "content": "q3"},
                {"role": "assistant", "content": "a3", "loss_weight": 0},
            ]
        }
    )
    assert conv.system == "S"
    assert conv.turns == [Turn("q1", "a1", False), Turn("q2", "a2", True), Turn("q3", "a3", False)]


def test_messages_tool_calls_and_tool_results():
    calls = [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]
    conv = conv_of(
        {
            "messages": [
                {"role": "user", "content": "Call f."},
                {"role": "assistant", "content": "<think>ok</think>", "tool_calls": calls},
                {"role": "tool", "content": [{"result": "é"}]},
                {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "function", "content": {"r": 2}},
                {"role": "assistant", "content": "Done."},
            ],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        }
    )
    assert conv.turns == [
        Turn("Call f.", "<think>ok</think>", tool_calls=calls),
        Turn('{"result": "é"}', "", tool_calls=calls, tool_result=True),
        Turn('{"r": 2}', "Done.", tool_result=True),
    ]
    assert conv.system is None
    assert conv.tools == [{"type": "function", "function": {"name": "f"}}]


def test_messages_errors():
    with pytest.raises(DataError, match=r"^d.jsonl:7: messages\[1\]: unknown role 'critic'; expected system, user, assistant or tool$"):
        conv_of({"messages": [{"role": "user", "content": "q"}, {"role": "critic", "content": "a"}]})
    with pytest.raises(DataError, match=r"^d.jsonl:7: messages\[0\] must be an object with 'role' and 'content'$"):
        conv_of({"messages": [{"content": "q"}]})
    with pytest.raises(DataError, match=r"^d.jsonl:7: messages\[1\].content: unsupported content part .*only text is supported$"):
        conv_of({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "image", "url": "x"}]}]})
    with pytest.raises(DataError, match=r"^d.jsonl:7: 'messages' must be a list of \{role, content\}$"):
        conv_of({"messages": {"role": "user"}})


# ---------------------------------------------------------------------------------------------------------------
# the real demo files
# ---------------------------------------------------------------------------------------------------------------


def _parse(relpath: str):
    records = read_records(str(DATA_DIR / relpath))
    formats = {detect_format(r) for r in records}
    assert len(formats) == 1
    (fmt,) = formats
    for r in records:
        check_format(r, fmt)
    return records, fmt, [to_conversation(r, fmt) for r in records]


@needs_data
def test_demo_alpaca_en():
    records, fmt, convs = _parse("llamafactory/alpaca_en_demo.json")
    assert (len(records), fmt) == (999, "alpaca")
    assert [r.line for r in records[:3]] == [2, 7, 12] and records[-1].line == 4992
    assert all(len(c.turns) == 1 and c.turns[0].train and c.system is None for c in convs)
    assert convs[0].turns[0].user == "Describe a process of making crepes."
    assert convs[0].turns[0].assistant.startswith("Making crepes is an easy and delicious process! Here are step-by-step")
    # record 6 (line 27) has an input: joined to the instruction with a newline
    assert records[5].line == 27
    assert convs[5].turns[0].user == "Given the parameters of a triangle, find out its perimeter.\nSide 1 = 4\nSide 2 = 6\nSide 3 = 8"
    assert convs[5].turns[0].assistant.endswith("Therefore, the perimeter of the triangle is 18 units.")
    assert sum("\n" in c.turns[0].user for c, r in zip(convs, records) if r.data["input"]) == 412


@needs_data
def test_demo_identity():
    records, fmt, convs = _parse("llamafactory/identity.json")
    assert (len(records), fmt) == (91, "alpaca")
    assert convs[0].turns == [Turn("hi", "Hello! I am {{name}}, an AI assistant developed by {{author}}. How can I assist you today?")]
    assert records[-1].line == 452
    assert convs[-1].turns[0].user == "你是OpenAI开发的ChatGPT吗？"
    assert convs[-1].turns[0].assistant == "抱歉，我不是 OpenAI 开发的 ChatGPT，我是 {{author}} 开发的 {{name}}，旨在为用户提供智能化的回答和帮助。"


@needs_data
def test_demo_glaive_toolcall_as_sharegpt():
    records, fmt, convs = _parse("llamafactory/glaive_toolcall_en_demo.json")
    assert (len(records), fmt) == (300, "sharegpt")
    assert [r.line for r in records[:3]] == [2, 39, 84]
    assert sum(len(c.turns) for c in convs) == 957
    # 109 records list no tools ("[]"); none has a system prompt
    assert sum(not c.tools for c in convs) == 109 and all(c.system is None for c in convs)
    # 211 function_call turns, each one structured call answered by one observation turn
    calls = [t.tool_calls for c in convs for t in c.turns if t.tool_calls]
    assert len(calls) == 211 and all(len(c) == 1 and c[0]["type"] == "function" for c in calls)
    assert sum(t.tool_result for c in convs for t in c.turns) == 211
    first = convs[0]
    assert len(first.turns) == 4
    assert first.turns[0] == Turn(
        "Hi, I have some ingredients and I want to cook something. Can you help me find a recipe?",
        "Of course! I can help you with that. Please tell me what ingredients you have.",
    )
    search = {"name": "search_recipes", "arguments": {"ingredients": ["chicken", "bell peppers", "rice"]}}
    assert first.turns[1] == Turn("I have chicken, bell peppers, and rice.", "", tool_calls=[{"type": "function", "function": search}])
    assert first.turns[2].user.startswith('{"recipes": [{"name": "Chicken and Bell Pepper Stir Fry"')  # observation
    assert first.turns[2].tool_result and not first.turns[3].tool_result
    assert first.turns[2].assistant.startswith("I found two recipes for you.")
    assert first.tools == json.loads(records[0].data["tools"])
    assert first.tools[0]["description"] == "Search for recipes based on ingredients"


@needs_data
def test_demo_v1_sft_messages():
    records, fmt, convs = _parse("llamafactory/v1_sft_demo.jsonl")
    assert (len(records), fmt) == (500, "messages")
    assert [r.line for r in records[:3]] == [1, 2, 3] and records[-1].line == 500
    assert convs[0].turns == [Turn("hi", "Hello! I am {{name}}, an AI assistant developed by {{author}}. How can I assist you today?", True)]
    assert convs[1].turns[0].user == "hello"
    assert all(len(c.turns) == 1 and c.turns[0].train for c in convs)  # user loss_weight 0 does not mask the response


@needs_data
def test_demo_erniekit_sft():
    records, fmt, convs = _parse("erniekit/sft-train-10lines.jsonl")
    assert (len(records), fmt) == (10, "erniekit")
    assert [r.line for r in records] == list(range(1, 11))
    assert convs[0].turns == [Turn("针对产品发布提出五种营销策略。", "1. 社交媒体活动。\n2. 电子邮件营销。\n3. 在线和离线广告。\n4. 推荐和评论。\n5. 合作名人推销。")]
    assert convs[2].turns == [Turn("列出三个描述人的常见形容词", "描述人的三个常见形容词是自信、友好和善良。")]
    assert all(c.system is None for c in convs)


@needs_data
def test_demo_erniekit_function_call_as_messages():
    records, fmt, convs = _parse("erniekit/function-call-train.jsonl")
    assert (len(records), fmt) == (227, "messages")
    assert sum(len(c.turns) for c in convs) == 939
    assert all(c.system is None and c.tools == r.data["tools"] and c.tools[0]["type"] == "function" for c, r in zip(convs, records))
    # 422 assistant messages call a tool, each after its <think> reasoning; each call's result opens the next turn
    calling = [t for c in convs for t in c.turns if t.tool_calls]
    assert len(calling) == 422 and all(t.assistant.startswith("<think>") and t.assistant.endswith("</think>") for t in calling)
    assert sum(t.tool_result for c in convs for t in c.turns) == 422
    first = convs[0]
    assert len(first.turns) == 5
    assert first.turns[0].user == "Hi, can you tell me the current stock price of Apple?"
    assert first.turns[0].assistant.startswith("<think>Alright, the user asked for the current stock price of Apple.")
    assert first.turns[0].tool_calls == [{"type": "function", "function": {"name": "get_stock_price", "arguments": {"company": "Apple"}}}]
    assert first.turns[1] == Turn('{"stock_price": "$150.75"}', "The current stock price of Apple is $150.75.", tool_result=True)
    assert first.turns[4] == Turn("Thank you for the information.", "You're welcome! If you have any other questions, feel free to ask.")


@needs_data
def test_demo_erniekit_dpo_file_is_not_sft():
    records = read_records(str(DATA_DIR / "erniekit/dpo-train-10lines.jsonl"))
    assert len(records) == 10 and detect_format(records[0]) == "erniekit"
    with pytest.raises(DataError, match=r"dpo-train-10lines.jsonl:1: 'src' has 1 turns but 'tgt' has 0"):
        to_conversation(records[0], "erniekit")
