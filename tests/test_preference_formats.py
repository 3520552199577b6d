"""Preference (DPO) records -> Preference: erniekit, sharegpt, trl, alpaca; detection, Skip reasons, file:line errors,
and the real demo files in ../shared/data."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from conftest import DATA_DIR, SHARED_HOW, needs

from erniekit_lite.data.formats import (
    PREFERENCE_FORMATS,
    Preference,
    Skip,
    Turn,
    detect_preference_format,
    to_preference,
)
from erniekit_lite.data.load import Record, read_records
from erniekit_lite.errors import DataError

pytestmark = needs(DATA_DIR.is_dir(), f"the shared demo data at {DATA_DIR}", SHARED_HOW)

ERNIEKIT_DPO = DATA_DIR / "erniekit" / "dpo-train-10lines.jsonl"
SHAREGPT_DPO = DATA_DIR / "llamafactory" / "dpo_en_demo.json"


def write_jsonl(tmp_path, records, name="prefs.jsonl"):
    """One record per line (line N = records[N-1]); a str item is written verbatim."""
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in records) + "\n", encoding="utf-8")
    return path


def pref_of(data, fmt=None, default_system=None) -> Preference:
    r = Record(data, "d.jsonl", 7)
    return to_preference(r, fmt or detect_preference_format(r), default_system)


def parse_all(path) -> tuple[list[Record], list[Preference], Counter]:
    records = read_records(str(path))
    prefs, skipped = [], Counter()
    for r in records:
        try:
            prefs.append(to_preference(r, detect_preference_format(r)))
        except Skip as e:
            skipped[str(e)] += 1
    return records, prefs, skipped


# ---------------------------------------------------------------------------------------------------------------
# the real demo files
# ---------------------------------------------------------------------------------------------------------------


def test_erniekit_demo_file():
    records, prefs, skipped = parse_all(ERNIEKIT_DPO)
    assert len(records) == 10 and len(prefs) == 10 and not skipped
    assert {detect_preference_format(r) for r in records} == {"erniekit"}
    assert [r.line for r in records] == list(range(1, 11))
    assert all(r.data["sort"] == [1, 0] for r in records)  # response[0] is always the chosen one in this file
    first = prefs[0]
    assert first == Preference(
        history=[],
        prompt="哪一个富含蛋白质，床还是墙？",
        chosen="床和墙都不是蛋白质的来源，因为它们都是无生命的物体。蛋白质通常存在于肉类、奶制品、豆类和坚果等食物中。",
        rejected="对不起，我无法回答那个问题。请提供更具体的信息，让我知道你需要什么帮助。",
        system=None,
    )
    for r, p in zip(records, prefs):
        assert (p.chosen, p.rejected) == (r.data["response"][0][0], r.data["response"][1][0])
        assert p.prompt == r.data["src"][-1] and p.history == []


def test_erniekit_sort_decides_which_response_is_chosen(tmp_path):
    first = read_records(str(ERNIEKIT_DPO))[0].data
    swapped = dict(first, sort=[0, 1])
    _, prefs, _ = parse_all(write_jsonl(tmp_path, [first, swapped]))
    assert prefs[1].chosen == prefs[0].rejected == first["response"][1][0]
    assert prefs[1].rejected == prefs[0].chosen == first["response"][0][0]
    # any numbers, not just 0/1; the higher one wins
    assert pref_of(dict(first, sort=[-2.5, 3])).chosen == first["response"][1][0]
    assert pref_of(dict(first, sort=[10, 9])).chosen == first["response"][0][0]


def test_sharegpt_demo_file():
    records, prefs, skipped = parse_all(SHAREGPT_DPO)
    assert len(records) == 300 and len(prefs) == 300 and not skipped
    assert {detect_preference_format(r) for r in records} == {"sharegpt"}
    raw = json.loads(SHAREGPT_DPO.read_text(encoding="utf-8"))
    first = prefs[0]
    assert records[0].line == 2  # the array's first object opens on line 2
    assert first.history == [] and first.system is None
    assert first.prompt == "Hi! I'd like to create a new language game simulating the first person perspective of a character named Angela."
    assert first.chosen.startswith("That sounds like a fun and engaging idea! Here are some tips to help you create the game:\n1. Start")
    assert first.chosen.endswith("simulating the first person perspective of Angela. Good luck!") and len(first.chosen) == 1688
    assert first.rejected.startswith("Hello! I'd be happy to help you create a language game simulating the first-person perspective")
    assert first.rejected.endswith("as your helpful, respectful, and honest assistant! 😊")
    assert (first.chosen, first.rejected) == (raw[0]["chosen"]["value"], raw[0]["rejected"]["value"])
    # 80 records carry their system prompt as a leading {"from": "system"} turn, not a "system" key
    with_system = [(r, p) for r, p in zip(records, prefs) if r.data["conversations"][0]["from"] == "system"]
    assert len(with_system) == 80 and all("system" not in r.data for r, _ in with_system)
    assert all(p.system == r.data["conversations"][0]["value"] for r, p in with_system)
    assert sum(1 for p in prefs if p.system is None) == 220
    # multi-turn: earlier human/gpt pairs become context-only history
    assert Counter(len(p.history) for p in prefs) == {0: 194, 2: 57, 3: 46, 1: 1, 4: 1, 6: 1}
    one = next(p for p in prefs if len(p.history) == 1)
    assert one.history == [Turn("Hi", "Hello! How can I help you today? If you have any questions or need assistance, feel free to ask.", False)]
    assert one.prompt == "i am bored."
    assert all(not t.train for p in prefs for t in p.history)
    for r, p in zip(records, prefs):
        assert p.prompt == r.data["conversations"][-1]["value"]


def test_default_system_only_when_the_record_has_none():
    records = read_records(str(SHAREGPT_DPO))
    sys_record = next(r for r in records if r.data["conversations"][0]["from"] == "system")
    plain = records[0]
    assert to_preference(plain, "sharegpt", "Be brief.").system == "Be brief."
    assert to_preference(sys_record, "sharegpt", "Be brief.").system == sys_record.data["conversations"][0]["value"]
    first = read_records(str(ERNIEKIT_DPO))[0]
    assert to_preference(first, "erniekit", "Be brief.").system == "Be brief."
    assert pref_of(dict(first.data, system="Own."), default_system="Be brief.").system == "Own."


# ---------------------------------------------------------------------------------------------------------------
# detection
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, fmt",
    [
        ({"src": ["q"], "tgt": [], "response": [["a"], ["b"]], "sort": [1, 0]}, "erniekit"),
        ({"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": "a"}, "rejected": {"from": "gpt", "value": "b"}}, "sharegpt"),
        ({"prompt": "q", "chosen": "a", "rejected": "b"}, "trl"),
        ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}], "rejected": []}, "trl"),
        ({"question": "q", "chosen": "a", "rejected": "b"}, "alpaca"),
        ({"instruction": "q", "input": "x", "chosen": "a", "rejected": "b"}, "alpaca"),
    ],
)
def test_detect_preference_format(data, fmt):
    assert detect_preference_format(Record(data, "d.jsonl", 1)) == fmt
    assert fmt in PREFERENCE_FORMATS


def test_detect_preference_format_order():
    # src+response wins over everything; conversations+chosen wins over prompt+chosen
    both = {"src": ["q"], "response": [["a"], ["b"]], "sort": [1, 0], "prompt": "p", "chosen": "a"}
    assert detect_preference_format(Record(both, "d", 1)) == "erniekit"
    conv = {"conversations": [], "prompt": "p", "chosen": "a", "question": "q"}
    assert detect_preference_format(Record(conv, "d", 1)) == "sharegpt"
    assert detect_preference_format(Record({"prompt": "p", "chosen": "a", "question": "q"}, "d", 1)) == "trl"


def test_detect_preference_format_errors(tmp_path):
    path = write_jsonl(
        tmp_path,
        [
            {"prompt": "q", "chosen": "a", "rejected": "b"},
            {"src": ["q"], "tgt": ["a"]},  # SFT, not preference data
            {"chosen": [{"role": "user", "content": "q"}], "rejected": []},  # TRL implicit prompt
            {},
            '["not", "an", "object"]',
        ],
    )
    records = read_records(str(path))
    assert detect_preference_format(records[0]) == "trl"
    with pytest.raises(DataError) as e:
        detect_preference_format(records[1])
    msg = str(e.value)
    assert msg.startswith(f"{path}:2: cannot tell the preference format from the keys (src, tgt)")
    assert "src/response/sort (erniekit)" in msg and "(sharegpt)" in msg and "prompt/chosen/rejected (trl)" in msg and "(alpaca)" in msg
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:3: .*keys \(chosen, rejected\).*implicit-prompt"):
        detect_preference_format(records[2])
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:4: .*keys \(none\)"):
        detect_preference_format(records[3])
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:5: expected a JSON object per record, got list"):
        detect_preference_format(records[4])
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:5: expected a JSON object per record, got list"):
        to_preference(records[4], "trl")
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:1: unknown preference format 'dpo'; expected one of erniekit, sharegpt, trl, alpaca"):
        to_preference(records[0], "dpo")


# ---------------------------------------------------------------------------------------------------------------
# each format
# ---------------------------------------------------------------------------------------------------------------


def test_erniekit_multi_turn_history_and_system():
    p = pref_of(
        {
            "system": "You are terse.",
            "src": ["q1", "q2", "q3"],
            "tgt": ["a1", "a2"],
            "response": [["worse"], ["better"]],
            "sort": [0, 1],
        }
    )
    assert p == Preference([Turn("q1", "a1", False), Turn("q2", "a2", False)], "q3", "better", "worse", "You are terse.")


def test_erniekit_plain_string_responses_and_missing_tgt():
    p = pref_of({"src": "q", "response": ["a", ["b"]], "sort": [1, 0]}, "erniekit")
    assert (p.history, p.prompt, p.chosen, p.rejected) == ([], "q", "a", "b")


def test_sharegpt_roles_system_key_and_merging():
    p = pref_of(
        {
            "system": "Key system.",
            "conversations": [
                {"from": "system", "value": "Turn system."},
                {"from": "human", "value": "q1"},
                {"from": "gpt", "value": "a1"},
                {"from": "user", "value": "q2"},
                {"from": "observation", "value": "tool output"},  # a user-side turn: joined with q2
            ],
            "chosen": {"from": "gpt", "value": "good"},
            "rejected": {"from": "assistant", "value": "bad"},
        }
    )
    assert p == Preference([Turn("q1", "a1", False)], "q2\ntool output", "good", "bad", "Key system.\nTurn system.")


def test_trl_string_form():
    assert pref_of({"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"}) == Preference([], "What is 2+2?", "4", "5", None)
    assert pref_of({"prompt": "q", "chosen": "a", "rejected": "b"}, default_system="S").system == "S"


def test_trl_conversational_form():
    p = pref_of(
        {
            "prompt": [
                {"role": "system", "content": "Be kind."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": [{"type": "text", "text": "Tell me a "}, {"type": "text", "text": "joke."}]},
            ],
            "chosen": [{"role": "assistant", "content": "Why did the chicken cross the road?"}],
            "rejected": [{"role": "assistant", "content": "No."}],
        }
    )
    assert p == Preference([Turn("Hi", "Hello!", False)], "Tell me a joke.", "Why did the chicken cross the road?", "No.", "Be kind.")
    # the conversational prompt may be a single user message; the responses may be plain strings
    q = pref_of({"prompt": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]})
    assert q == Preference([], "q", "a", "b", None)


def test_alpaca_with_system_and_history():
    p = pref_of(
        {
            "system": "You are a poet.",
            "history": [["Hi", "Hello"], ["Who are you?", "A poet."]],
            "instruction": "Write a haiku",
            "input": "about rain",
            "chosen": "Soft rain on the roof",
            "rejected": "Rain.",
        }
    )
    assert p == Preference(
        [Turn("Hi", "Hello", False), Turn("Who are you?", "A poet.", False)], "Write a haiku\nabout rain", "Soft rain on the roof", "Rain.", "You are a poet."
    )
    q = pref_of({"question": "Why?", "chosen": "Because.", "rejected": "No.", "history": None}, default_system="D")
    assert q == Preference([], "Why?", "Because.", "No.", "D")
    assert pref_of({"instruction": "Do it", "input": "", "chosen": "ok", "rejected": "no"}).prompt == "Do it"


# ---------------------------------------------------------------------------------------------------------------
# Skip: well-formed but untrainable
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, reason",
    [
        ({"src": ["q"], "tgt": [], "response": [["a"], ["b"]], "sort": [1, 1]}, "tied sort"),
        ({"src": ["q"], "tgt": [], "response": [["a"], ["b"]], "sort": [0.5, 0.5]}, "tied sort"),
        ({"src": ["q"], "tgt": [], "response": [["same"], ["same"]], "sort": [1, 0]}, "identical chosen and rejected"),
        ({"src": ["q"], "tgt": [], "response": [[""], ["b"]], "sort": [1, 0]}, "empty response"),
        ({"prompt": "q", "chosen": "same", "rejected": "same"}, "identical chosen and rejected"),
        ({"prompt": "q", "chosen": "same\n", "rejected": " same"}, "identical chosen and rejected"),
        ({"prompt": "q", "chosen": "a", "rejected": "   \n"}, "empty response"),
        ({"prompt": "q", "chosen": "", "rejected": ""}, "empty response"),
        ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": " "}], "rejected": "b"}, "empty response"),
        ({"question": "q", "chosen": "x", "rejected": "x"}, "identical chosen and rejected"),
        ({"question": "q", "chosen": "", "rejected": "x"}, "empty response"),
        (
            {"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": "x"}, "rejected": {"from": "gpt", "value": "x"}},
            "identical chosen and rejected",
        ),
        (
            {"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": "x"}, "rejected": {"from": "gpt", "value": ""}},
            "empty response",
        ),
    ],
)
def test_skip_reasons(data, reason):
    with pytest.raises(Skip) as e:
        pref_of(data)
    assert str(e.value) == reason
    assert not isinstance(e.value, DataError)


def test_skips_are_counted_by_reason(tmp_path):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    path = write_jsonl(
        tmp_path,
        [good, dict(good, rejected="a"), dict(good, chosen=""), {"src": ["q"], "tgt": [], "response": [["a"], ["b"]], "sort": [2, 2]}, good],
    )
    _, prefs, skipped = parse_all(path)
    assert len(prefs) == 2
    assert skipped == {"identical chosen and rejected": 1, "empty response": 1, "tied sort": 1}


# ---------------------------------------------------------------------------------------------------------------
# malformed records: DataError at path:LINE naming the field
# ---------------------------------------------------------------------------------------------------------------

ERNIE = {"src": ["q"], "tgt": [], "response": [["a"], ["b"]], "sort": [1, 0]}
SHARE = {"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": "a"}, "rejected": {"from": "gpt", "value": "b"}}
TRL = {"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]}
ALPACA = {"instruction": "q", "chosen": "a", "rejected": "b"}

MALFORMED = [
    ("erniekit", dict(ERNIE, src=["q1", "q2"], tgt=[]), r"'src' has 2 turns but 'tgt' has 0"),
    ("erniekit", dict(ERNIE, tgt=["a0"]), r"'src' has 1 turns but 'tgt' has 1"),
    ("erniekit", dict(ERNIE, src=[]), r"field 'src' is empty"),
    ("erniekit", dict(ERNIE, src=[1]), r"field 'src' must be a list of strings"),
    ("erniekit", dict(ERNIE, response=[["a"]]), r"field 'response' must be a list of two responses"),
    ("erniekit", dict(ERNIE, response="a"), r"field 'response' must be a list of two responses"),
    ("erniekit", dict(ERNIE, response=[["a", "c"], ["b"]]), r"response\[0\] must be a list holding one string"),
    ("erniekit", dict(ERNIE, response=[["a"], [3]]), r"response\[1\] must be a list holding one string"),
    ("erniekit", {k: v for k, v in ERNIE.items() if k != "sort"}, r"missing field 'sort'"),
    ("erniekit", dict(ERNIE, sort=[1]), r"field 'sort' must be a list of two numbers"),
    ("erniekit", dict(ERNIE, sort=["1", "0"]), r"field 'sort' must be a list of two numbers"),
    ("erniekit", dict(ERNIE, sort=[True, False]), r"field 'sort' must be a list of two numbers"),
    ("erniekit", dict(ERNIE, system=5), r"field 'system' must be a string"),
    ("sharegpt", dict(SHARE, conversations="q"), r"'conversations' must be a list"),
    ("sharegpt", dict(SHARE, conversations=[{"from": "human"}]), r"conversations\[0\] must be an object with 'from' and 'value'"),
    ("sharegpt", dict(SHARE, conversations=[{"from": "robot", "value": "q"}]), r"conversations\[0\]: unknown role 'from: robot'"),
    ("sharegpt", dict(SHARE, conversations=[{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]), r"'conversations' must end with a user message"),
    ("sharegpt", dict(SHARE, conversations=[{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]), r"'conversations' must start with a user message"),
    ("sharegpt", dict(SHARE, conversations=[{"from": "system", "value": "s"}]), r"'conversations' has no user message"),
    ("sharegpt", dict(SHARE, chosen={"from": "human", "value": "a"}), r"field 'chosen': the response must come from the assistant"),
    ("sharegpt", dict(SHARE, rejected=["b"]), r"field 'rejected' must be an object with 'from' and 'value'"),
    ("sharegpt", {k: v for k, v in SHARE.items() if k != "rejected"}, r"missing field 'rejected'"),
    ("trl", dict(TRL, prompt=3), r"field 'prompt' must be a string or a list"),
    ("trl", dict(TRL, prompt=[{"role": "user"}]), r"prompt\[0\] must be an object with 'role' and 'content'"),
    ("trl", dict(TRL, prompt=[{"role": "narrator", "content": "q"}]), r"prompt\[0\]: unknown role 'narrator'"),
    ("trl", dict(TRL, prompt=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]), r"'prompt' must end with a user message"),
    ("trl", dict(TRL, prompt=[]), r"'prompt' has no user message"),
    ("trl", dict(TRL, chosen=[{"role": "user", "content": "a"}]), r"field 'chosen' must hold exactly one assistant message, got roles: user"),
    ("trl", dict(TRL, rejected=[]), r"field 'rejected' must hold exactly one assistant message, got roles: none"),
    ("trl", dict(TRL, chosen={"role": "assistant", "content": "a"}), r"field 'chosen' must be a string or a list"),
    ("trl", {k: v for k, v in TRL.items() if k != "rejected"}, r"missing field 'rejected'"),
    ("alpaca", dict(ALPACA, chosen=["a"]), r"field 'chosen' must be a string, got list"),
    ("alpaca", {"question": "q", "chosen": "a"}, r"missing field 'rejected'"),
    ("alpaca", dict(ALPACA, instruction=None), r"field 'instruction' must be a string, got NoneType"),
    ("alpaca", dict(ALPACA, history=[["q"]]), r"'history' must be a list of \[prompt, response\] pairs"),
    ("alpaca", dict(ALPACA, history=[["q", 1]]), r"'history' must hold strings"),
]


def test_malformed_records_name_file_line_and_field(tmp_path):
    # one good record first, then the malformed ones, so each lands on a known line (2, 3, ...)
    path = write_jsonl(tmp_path, [ALPACA] + [data for _, data, _ in MALFORMED])
    records = read_records(str(path))
    assert to_preference(records[0], "alpaca").prompt == "q"
    for (fmt, _, pattern), record in zip(MALFORMED, records[1:]):
        with pytest.raises(DataError) as e:
            to_preference(record, fmt)
        assert str(e.value).startswith(f"{path}:{record.line}: "), str(e.value)
        assert e.value.line == record.line and record.line >= 2
        assert re.search(pattern, str(e.value)), (fmt, pattern, str(e.value))


def test_malformed_in_a_json_array_reports_the_record_line(tmp_path):
    path = tmp_path / "prefs.json"
    path.write_text(
        '[\n  {"prompt": "q", "chosen": "a", "rejected": "b"},\n  {\n    "prompt": "q",\n    "chosen": 1,\n    "rejected": "b"\n  }\n]\n',
        encoding="utf-8",
    )
    records = read_records(str(path))
    assert to_preference(records[0], detect_preference_format(records[0])).chosen == "a"
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:3: field 'chosen' must be a string or a list"):
        to_preference(records[1], detect_preference_format(records[1]))


def test_explicit_format_that_does_not_fit_the_record():
    with pytest.raises(DataError, match=r"^d.jsonl:7: missing field 'conversations'"):
        pref_of({"prompt": "q", "chosen": "a", "rejected": "b"}, "sharegpt")
    with pytest.raises(DataError, match=r"^d.jsonl:7: missing field 'src'"):
        pref_of({"prompt": "q", "chosen": "a", "rejected": "b"}, "erniekit")
    with pytest.raises(DataError, match=r"^d.jsonl:7: missing field 'prompt'"):
        pref_of({"question": "q", "chosen": "a", "rejected": "b"}, "trl")
    with pytest.raises(DataError, match=r"^d.jsonl:7: missing field 'question'"):
        pref_of({"prompt": "q", "chosen": "a", "rejected": "b"}, "alpaca")


def test_tools_are_appended_to_the_system_prompt_as_for_sft():
    p = pref_of(dict(SHARE, tools='[{"name": "f"}]'), default_system="S")
    assert p.system == 'S\n\nTools: [{"name": "f"}]'
    assert pref_of(dict(SHARE, tools="[]")).system is None  # glaive writes "[]" for no tools
    assert pref_of(dict(TRL, tools=[{"name": "f"}])).system == 'Tools: [{"name": "f"}]'
