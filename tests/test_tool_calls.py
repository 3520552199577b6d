"""Function-call data end to end: ERNIEKit `messages` + `tool_calls` + `tools` and sharegpt function_call/observation
records, tokenized through ERNIE 4.5's template (tools and calls as text) and through the chat template released with
baidu/ERNIE-4.5-21B-A3B-Thinking (`THINKING_TEMPLATE`, read verbatim from ../shared; tools, calls and results in its
own slots), with loss on exactly the assistant tokens. What that template does, and these tests pin:

    <|im_start|>system\n[<system_setting>\n{system}\n</system_setting>\n\n]<global_setting>\nthink_mode=True\n</global_setting>
        [\n\n<tool_list>\n[{"type": "function", "function": {tool.function}},...]\n</tool_list>]<|im_end|>\n\n
    <|im_start|>user\n{q}<|im_end|>\n\n                                   (a tool result, its text as a JSON string:)
    <|im_start|>tool\n<tool_output>"{result}"</tool_output><|im_end|>\n\n
    <|im_start|>assistant\n<think>\n                                     (generation prompt, appended whatever
                                                                          add_generation_prompt says)
    {reasoning}\n</think>\n[<response>\n{answer}\n</response>\n][\n<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>\n]
        <|im_end|>\n\n                                                       (trained)

An answer keeps its `<think>` block only after the last user query, and then only when it is the last message or has
reasoning: an earlier answer loses it once a later user turn follows, an answer without reasoning once a tool result
follows (so such conversations are cut into one sample per trained turn). `<|im_start|>` / `<|im_end|>` are added to
the 0.3B tokenizer as control tokens, as the Thinking tokenizer is assumed to have them (FastDeploy feeds them as
tokens); every other tag stays text.
"""

from __future__ import annotations

import copy
import json

import pytest

from erniekit_lite.data.formats import Conversation, Turn, detect_format, to_conversation
from erniekit_lite.data.load import Record, read_records
from erniekit_lite.data.template import ErnieTemplate, ModelTemplate, template_for
from erniekit_lite.data.tokenize import IGNORE, Tokenizer
from erniekit_lite.errors import DataError, UserError

from conftest import DATA_DIR, ROOT, SHARED, SHARED_HOW, missing

BOS, EOT, EOS = 100273, 100272, 2
X = IGNORE
RECIPE = ROOT / "recipes" / "ernie-4.5-21b-a3b-thinking" / "sft-lora-function-call.yaml"
ERNIEKIT_FC = DATA_DIR / "erniekit" / "function-call-train.jsonl"
GLAIVE = DATA_DIR / "llamafactory" / "glaive_toolcall_en_demo.json"
SHIPPED_FC = ROOT / "recipes" / "data" / "function_call_demo.jsonl"  # the function-call recipe's demo data
CONTROL = ["<|im_start|>", "<|im_end|>"]

THINKING_FILE = SHARED / "ernie45" / "ernie-4.5-21b-a3b-thinking" / "chat_template.jinja"
# the released template, verbatim; without ../shared every test using it is skipped (its fixtures need the tokenizer)
THINKING_TEMPLATE = THINKING_FILE.read_text(encoding="utf-8") if THINKING_FILE.is_file() else ""

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"city": "string"}}}
# one conversation in both formats: a reasoned tool call, its result, the answer
ERNIEKIT_RECORD = {
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "<think>Ask the tool.</think>", "tool_calls": [CALL]},
        {"role": "tool", "content": [{"temp": 20}]},
        {"role": "assistant", "content": "It is 20 degrees."},
    ],
    "tools": [TOOL],
}
SHAREGPT_RECORD = {
    "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": '{"temp": 20}'},
        {"from": "gpt", "value": "It is 20 degrees."},
    ],
    "tools": '[{"name": "get_weather", "parameters": {"city": "string"}}]',
}


def _conv(data: dict) -> Conversation:
    record = Record(data, "fc.jsonl", 1)
    return to_conversation(record, detect_format(record))


def _one(tok: Tokenizer, conv: Conversation):
    (sample,), stats = tok([conv], 100_000)
    return sample, stats


def _encode(tokenizer, text: str, special: bool = False) -> list[int]:
    return tokenizer(text, add_special_tokens=False, split_special_tokens=not special)["input_ids"]


@pytest.fixture(scope="module")
def ernie_tok(ernie_tokenizer):
    return Tokenizer(ernie_tokenizer, template_for(ernie_tokenizer))


@pytest.fixture(scope="module")
def thinking_tokenizer(ernie_tokenizer):
    tokenizer = copy.deepcopy(ernie_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": CONTROL})
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def thinking_tok(thinking_tokenizer):
    return Tokenizer(thinking_tokenizer, template_for(thinking_tokenizer))


# ---------------------------------------------------------------------------------------------------------------
# ERNIE 4.5's template (no tool role): tools after the system prompt, calls after the text, results as user turns
# ---------------------------------------------------------------------------------------------------------------

# Tools : ▁[ {" type ": ▁" function ", ▁" function ": ▁{" name ": ▁" get _ weather ", ▁" parameters ": ▁{" city ": ▁" string " }}} ] \n
TOOLS_LINE = [20353, 93963, 612, 5806, 727, 1078, 376, 1281, 507, 376, 1281, 1078, 13492, 695, 1078, 376, 490, 93944,
              46126, 507, 376, 11209, 1078, 13492, 18549, 1078, 376, 1207, 93946, 15266, 93989, 23]
# User : ▁Weather ▁in ▁Paris ? \n Assistant : ▁
PROMPT_1 = [2969, 93963, 57320, 307, 11855, 94009, 23, 92267, 93963, 93919]
# < think > Ask ▁the ▁tool .</ think > \n [ {" type ": ▁" function ", ▁" function ": ▁{" name ": ▁" get _ weather ",
# ▁" arguments ": ▁{" city ": ▁" Paris " }}} ]
RESPONSE_1 = [93953, 18387, 93951, 31242, 290, 4547, 1945, 18387, 93951, 23, 93988, 5806, 727, 1078, 376, 1281, 507,
              376, 1281, 1078, 13492, 695, 1078, 376, 490, 93944, 46126, 507, 376, 13157, 1078, 13492, 18549, 1078,
              376, 63208, 93946, 15266, 93989]
# User : ▁{" temp ": ▁ 2 0 } \n Assistant : ▁        (the tool result is the next user turn, untrained)
PROMPT_2 = [2969, 93963, 13492, 6228, 1078, 93919, 5, 3, 93973, 23, 92267, 93963, 93919]
RESPONSE_2 = [2070, 357, 93919, 5, 3, 14933, 93937]  # It ▁is ▁ 2 0 ▁degrees .


def test_erniekit_record_exact_ids_and_labels_with_ernie_template(ernie_tokenizer, ernie_tok):
    assert isinstance(ernie_tok.template, ErnieTemplate)
    sample, stats = _one(ernie_tok, _conv(ERNIEKIT_RECORD))
    assert sample.input_ids == [BOS, *TOOLS_LINE, *PROMPT_1, *RESPONSE_1, EOT, *PROMPT_2, *RESPONSE_2, EOT]
    # the response (reasoning and tool call) and its end of turn are trained, </s> on each <|end_of_sentence|>
    assert sample.labels == [X] * 43 + RESPONSE_1 + [EOS] + [X] * 13 + RESPONSE_2 + [EOS]
    assert stats.trained_tokens == len(RESPONSE_1) + len(RESPONSE_2) + 2
    # the literals are these texts, each piece tokenized on its own
    assert TOOLS_LINE + PROMPT_1 == _encode(
        ernie_tokenizer,
        'Tools: [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "string"}}}]\n'
        "User: Weather in Paris?\nAssistant: ",
    )
    assert RESPONSE_1 == _encode(
        ernie_tokenizer,
        '<think>Ask the tool.</think>\n[{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]',
    )
    assert PROMPT_2 + RESPONSE_2 == _encode(ernie_tokenizer, 'User: {"temp": 20}\nAssistant: ') + _encode(ernie_tokenizer, "It is 20 degrees.")


def test_sharegpt_record_exact_ids_and_labels_with_ernie_template(ernie_tokenizer, ernie_tok):
    """The same conversation from sharegpt: no reasoning, and glaive's bare tool schema as written."""
    sample, _ = _one(ernie_tok, _conv(SHAREGPT_RECORD))
    tools_and_prompt = _encode(
        ernie_tokenizer, 'Tools: [{"name": "get_weather", "parameters": {"city": "string"}}]\nUser: Weather in Paris?\nAssistant: '
    )
    call = RESPONSE_1[10:]  # the JSON list of calls, without the reasoning line
    assert sample.input_ids == [BOS, *tools_and_prompt, *call, EOT, *PROMPT_2, *RESPONSE_2, EOT]
    assert sample.labels == [X] * (1 + len(tools_and_prompt)) + call + [EOS] + [X] * 13 + RESPONSE_2 + [EOS]


# ---------------------------------------------------------------------------------------------------------------
# A Thinking-style template shipped with the model: its own slots for tools, calls and results
# ---------------------------------------------------------------------------------------------------------------

SYSTEM_PROMPT_1 = (
    "<|im_start|>system\n<global_setting>\nthink_mode=True\n</global_setting>\n\n<tool_list>\n"
    '[{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "string"}}}]\n</tool_list><|im_end|>\n\n'
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n\n<|im_start|>assistant\n<think>\n"
)
CALL_TEXT = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<|im_end|>\n\n'
# the tool's text as a JSON string (the template's `tojson`), still tokenized as text
RESULT_TEXT = '{\\"temp\\": 20}'
RESULT_PROMPT = '<|im_start|>tool\n<tool_output>"' + RESULT_TEXT + '"</tool_output><|im_end|>\n\n<|im_start|>assistant\n<think>\n'
ANSWER = "\n</think>\n<response>\nIt is 20 degrees.\n</response>\n<|im_end|>\n\n"  # no reasoning: an empty block
GENERATION_PROMPT = "<|im_start|>assistant\n<think>\n"


def test_thinking_template_pieces_ids_and_labels(thinking_tokenizer, thinking_tok):
    """A reasoned tool call, its result, the answer: one sample (the template keeps a reasoned answer's <think> block
    when a tool result follows). Each prompt ends by opening the reasoning; the trained piece is the rest of the turn."""
    assert isinstance(thinking_tok.template, ModelTemplate)
    conv = _conv(ERNIEKIT_RECORD)
    assert thinking_tok.template.expand(conv) == [conv]
    pieces = thinking_tok.template.pieces(conv)
    first_response = "Ask the tool.\n</think>\n" + CALL_TEXT
    # prompt pieces: the template's markup, cut where message text (tokenized as text) sits in it
    assert [["".join(p.text for p in turn if p.response == r) for r in (False, True)] for turn in pieces] == [
        [SYSTEM_PROMPT_1, first_response],
        [RESULT_PROMPT, ANSWER],
    ]
    assert [[p.trained for p in turn if p.response] for turn in pieces] == [[True], [True]]
    assert [p.text for turn in pieces for p in turn if not p.special] == ["Weather in Paris?", RESULT_TEXT]
    sample, stats = _one(thinking_tok, conv)
    texts = [SYSTEM_PROMPT_1, first_response, RESULT_PROMPT, ANSWER]
    encoded = [_encode(thinking_tokenizer, t, special=True) for t in texts]
    # the tool's text is tokenized on its own, as text: `"{` is one token inside the markup, two here
    head, tail = RESULT_PROMPT.split(RESULT_TEXT)
    encoded[2] = _encode(thinking_tokenizer, head, special=True) + _encode(thinking_tokenizer, RESULT_TEXT) + _encode(
        thinking_tokenizer, tail, special=True)
    assert encoded[2] != _encode(thinking_tokenizer, RESULT_PROMPT, special=True)
    assert sample.input_ids == [i for e in encoded for i in e]
    assert sample.labels == [X] * len(encoded[0]) + encoded[1] + [X] * len(encoded[2]) + encoded[3]
    assert stats.trained_tokens == len(encoded[1]) + len(encoded[3])
    # the control tokens are single ids: 2 per message and 2 per generation prompt (system, user, assistant, tool, assistant)
    im_start, im_end = thinking_tokenizer.convert_tokens_to_ids(CONTROL)
    assert sample.input_ids.count(im_start) == sample.input_ids.count(im_end) == 5
    assert [thinking_tokenizer.decode([t]) for t in sample.labels if t in (im_start, im_end)] == ["<|im_end|>"] * 2
    # the whole sample is the model's own rendering of the conversation, with the tools; the released template
    # appends the generation prompt even without add_generation_prompt, training's repaired copy does not
    messages = [m for turn in conv.turns for m in _chat_messages(turn)]
    rendered = thinking_tokenizer.apply_chat_template(messages, tools=conv.tools, tokenize=False)
    assert rendered == "".join(texts) + GENERATION_PROMPT
    assert thinking_tokenizer.apply_chat_template(messages, tools=conv.tools, tokenize=False,
                                                  chat_template=thinking_tok.template.chat_template) == "".join(texts)
    # and each response follows exactly what inference feeds the model (the rendering with the generation prompt)
    for n, start in ((1, len(encoded[0])), (3, sum(map(len, encoded[:3])))):
        prompt = thinking_tokenizer.apply_chat_template(messages[:n], tools=conv.tools, tokenize=False, add_generation_prompt=True)
        assert thinking_tokenizer.decode(sample.input_ids[:start]) == prompt
        assert sample.labels[start - 1] == X and sample.labels[start] != X


def test_thinking_template_drops_an_unreasoned_calls_think_block_so_each_turn_is_a_sample(thinking_tokenizer, thinking_tok):
    """The same conversation from sharegpt (no reasoning; glaive's bare tool schema, wrapped as templates read tools):
    alone, the call is the last message and renders an empty <think> block; once its result follows it renders none.
    So each turn is its own sample, its prompt the history as inference renders it."""
    conv = _conv(SHAREGPT_RECORD)
    assert conv.tools == [{"name": "get_weather", "parameters": {"city": "string"}}]
    parts = thinking_tok.template.expand(conv)
    assert [[(t.user, t.train) for t in p.turns] for p in parts] == [
        [("Weather in Paris?", True)], [("Weather in Paris?", False), ('{"temp": 20}', True)]]
    samples, stats = thinking_tok(parts, 100_000)
    assert stats.kept == 2
    texts = [(thinking_tokenizer.decode([i for i, l in zip(s.input_ids, s.labels) if l == X]),
              thinking_tokenizer.decode([l for l in s.labels if l != X])) for s in samples]
    assert texts == [
        (SYSTEM_PROMPT_1, "\n</think>\n" + CALL_TEXT),
        (SYSTEM_PROMPT_1.removesuffix("<think>\n") + CALL_TEXT + RESULT_PROMPT, ANSWER),
    ]
    messages = [m for turn in conv.turns for m in _chat_messages(turn)]
    tools = [{"type": "function", "function": conv.tools[0]}]
    for sample, n in zip(samples, (1, 3)):
        prompt = thinking_tokenizer.apply_chat_template(messages[:n], tools=tools, tokenize=False, add_generation_prompt=True)
        assert thinking_tokenizer.decode(sample.input_ids[: sample.labels.index(next(l for l in sample.labels if l != X))]) == prompt


def _chat_messages(turn: Turn) -> list[dict]:
    answer = {"role": "assistant", "content": turn.assistant}
    if turn.tool_calls:
        answer["tool_calls"] = turn.tool_calls
    return [{"role": "tool" if turn.tool_result else "user", "content": turn.user}, answer]


def test_thinking_template_cannot_train_an_answer_before_any_user_query(tmp_path, thinking_tokenizer, thinking_tok):
    """A conversation that opens with a tool result: the released template renders its answer without the <think>
    block its generation prompt opens (it keeps one only after a user query), so the completion cannot extend the
    prompt. One line, naming the turn and both texts; from a data file, also the file and the record's line.
    (Preference and feedback prompts read a tool result as a user turn, data/formats.py `_split_prompt`: no error.)"""
    from erniekit_lite.data.prepare import prepare
    from erniekit_lite.recipe import DataSection

    conv = Conversation([Turn('{"temp": 20}', "It is warm.", tool_result=True)])
    message = (r"the model's chat template cannot be split into trained turns: at turn 1 the rendering reads "
               r"'response>\\nIt is warm\.\\n</response>.*' where the previous one read 'think>\\n'")
    with pytest.raises(UserError, match="^" + message) as e:
        _one(thinking_tok, conv)
    assert "\n" not in str(e.value)

    tool_first = [{"role": "tool", "content": '{"temp": 20}'}]
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps(ERNIEKIT_RECORD) + "\n\n" + json.dumps({"messages": tool_first + [
        {"role": "assistant", "content": "It is warm."}]}) + "\n")
    with pytest.raises(DataError, match=f"^{sft}:3: " + message) as e:
        prepare(DataSection(train=[str(sft)]), thinking_tokenizer, log=lambda *_: None)
    assert "\n" not in str(e.value)


def test_thinking_template_system_prompt_and_masked_turn(thinking_tok):
    conv = _conv({**ERNIEKIT_RECORD, "messages": [{"role": "system", "content": "Be brief."}] + ERNIEKIT_RECORD["messages"]})
    conv.turns[0].train = False
    pieces = thinking_tok.template.pieces(conv)
    prompt = "".join(p.text for p in pieces[0] if not p.response)
    # the system text sits in <system_setting>, before the <global_setting> every rendering has
    assert prompt == SYSTEM_PROMPT_1.replace("system\n", "system\n<system_setting>\nBe brief.\n</system_setting>\n\n", 1)
    sample, _ = _one(thinking_tok, conv)
    trained = thinking_tok.tokenizer.decode([t for t in sample.labels if t != X])
    assert trained == ANSWER  # the masked tool-calling turn is context only


@pytest.mark.parametrize(
    "path, records, samples, calls, trained_turns",
    [(ERNIEKIT_FC, 227, 905, 422, 939), (GLAIVE, 300, 957, 211, 957), (SHIPPED_FC, 6, 11, 6, 14)],
    ids=["erniekit-messages", "glaive-sharegpt", "shipped-demo"],
)
def test_demo_files_train_exactly_the_assistant_turns(thinking_tokenizer, thinking_tok, ernie_tok, path, records, samples,
                                                      calls, trained_turns):
    """Multi-turn records are cut into one sample per trained turn wherever the template drops an earlier <think>
    block (a later user query, or a tool result after an answer without reasoning); every assistant turn is trained
    exactly once, right after a prompt that opens its reasoning."""
    if not path.is_file():
        missing(str(path), SHARED_HOW)
    convs = [to_conversation(r, detect_format(r)) for r in read_records(str(path))]
    assert len(convs) == records and sum(len(c.turns) for c in convs) == trained_turns
    parts = [p for c in convs for p in thinking_tok.template.expand(c)]
    assert len(parts) == samples and sum(t.train for p in parts for t in p.turns) == trained_turns
    tokenized, stats = thinking_tok(parts, 100_000)
    assert stats.kept == samples and stats.truncated == stats.dropped_overlong == stats.dropped_untrained == 0
    decode = thinking_tokenizer.decode
    for part, sample in zip(parts, tokenized):
        pieces = [p for turn in thinking_tok.template.pieces(part) for p in turn]
        # the trained tokens are the assistant pieces, concatenated; every other token is masked
        assert decode([t for t in sample.labels if t != X]) == "".join(p.text for p in pieces if p.trained)
        assert decode(sample.input_ids) == "".join(p.text for p in pieces)
        for before, piece in zip(pieces, pieces[1:]):
            if piece.trained:
                assert before.text.endswith(GENERATION_PROMPT) and not before.trained
                assert "\n</think>\n" in piece.text and piece.text.endswith("<|im_end|>\n\n")
    trained = "".join(p.text for c in parts for turn in thinking_tok.template.pieces(c) for p in turn if p.trained)
    assert trained.count('\n<tool_call>\n{"name": ') == calls  # (one reasoning text mentions the tag too)
    assert "<tool_output>" not in trained and "<tool_list>" not in trained
    # through ERNIE 4.5's template the same records train the same turns: one </s> per assistant turn
    tokenized, stats = ernie_tok(convs, 100_000)
    assert stats.kept == records and sum(s.labels.count(EOS) for s in tokenized) == trained_turns


# ---------------------------------------------------------------------------------------------------------------
# templates that cannot be cut into turns, and bad records
# ---------------------------------------------------------------------------------------------------------------

DROPS_REASONING = (  # Qwen3-style: an answered turn loses its <think> part once a later user turn follows
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' + (m.content.split('</think>')[-1] if not loop.last else m.content)"
    " + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
ALWAYS_PROMPTS = (  # the assistant header after the loop whatever add_generation_prompt says
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' -}}"
)


def test_template_that_always_prompts_is_a_one_line_error(thinking_tokenizer):
    tokenizer = copy.deepcopy(thinking_tokenizer)
    tokenizer.chat_template = ALWAYS_PROMPTS
    tok = Tokenizer(tokenizer, template_for(tokenizer))
    conv = Conversation([Turn("q1", "<think>r</think>a1"), Turn("q2", "a2")])
    for part in tok.template.expand(conv):
        with pytest.raises(UserError, match=r"^the model's chat template cannot be split into trained turns: at turn [12] the rendering reads ") as e:
            tok([part], 4096)
        assert "\n" not in str(e.value)  # one line: the snippets are repr()s


def test_template_that_drops_earlier_reasoning_trains_each_turn_as_its_own_sample(tmp_path, thinking_tokenizer):
    """Each assistant turn is a sample: its prompt is the conversation so far rendered for generation (earlier turns
    as the template shows them then: reasoning dropped), its completion that turn with its reasoning."""
    from erniekit_lite.data.prepare import prepare
    from erniekit_lite.recipe import DataSection

    tokenizer = copy.deepcopy(thinking_tokenizer)
    tokenizer.chat_template = DROPS_REASONING
    tok = Tokenizer(tokenizer, template_for(tokenizer))
    conv = Conversation([Turn("q1", "<think>r1</think>a1"), Turn("q2", "<think>r2</think>a2"), Turn("q3", "a3", train=False)])
    parts = tok.template.expand(conv)
    assert [[(t.user, t.train) for t in p.turns] for p in parts] == [[("q1", True)], [("q1", False), ("q2", True)]]
    samples, stats = tok(parts, 4096)
    assert stats.kept == 2
    texts = [(tokenizer.decode([i for i, l in zip(s.input_ids, s.labels) if l == X]),
              tokenizer.decode([l for l in s.labels if l != X])) for s in samples]
    assert texts == [
        ("<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n", "<think>r1</think>a1<|im_end|>\n"),
        ("<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n",
         "<think>r2</think>a2<|im_end|>\n"),
    ]
    # each prompt is exactly what inference feeds the model after that history
    for sample, n in zip(samples, (1, 3)):
        messages = [m for t in conv.turns for m in _chat_messages(t)][:n]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert sample.input_ids[: sample.labels.index(next(l for l in sample.labels if l != X))] == _encode(tokenizer, prompt, special=True)
    # through prepare: one record, two samples, and the log says why
    path = tmp_path / "multi.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>r1</think>a1"},
                                             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]}) + "\n")
    said = []
    data = prepare(DataSection(train=[str(path)], packing=False), tokenizer, log=said.append)
    assert data.train.sources[0].records == 1 and data.train.sources[0].samples == len(data.train.samples) == 2
    assert any("each trained assistant turn of 1 multi-turn conversations is its own sample" in line for line in said)
    # where nothing is rewritten (no reasoning to drop) the conversation stays one sample
    one = Conversation([Turn("q1", "a1"), Turn("q2", "a2")])
    assert tok.template.expand(one) == [one]


def test_bad_function_call_records_name_file_and_line(tmp_path, thinking_tokenizer):
    from erniekit_lite.data.prepare import prepare
    from erniekit_lite.recipe import DataSection

    good = json.dumps(ERNIEKIT_RECORD)
    bad_call = json.dumps({**ERNIEKIT_RECORD, "messages": [ERNIEKIT_RECORD["messages"][0], {"role": "assistant", "tool_calls": [{"arguments": {}}]}]})
    bad_tools = json.dumps({**SHAREGPT_RECORD, "tools": "get_weather(city)"})
    for lines, message in (
        ([good, bad_call], r"fc.jsonl:2: messages\[1\].tool_calls: a tool call must hold 'name' and 'arguments'"),
        ([json.dumps(SHAREGPT_RECORD), bad_tools], r"fc.jsonl:2: tools: expected JSON \(Expecting value at character 0\)$"),
    ):
        path = tmp_path / "fc.jsonl"
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(DataError, match=message):
            prepare(DataSection(train=[str(path)]), thinking_tokenizer, log=lambda *_: None)


# ---------------------------------------------------------------------------------------------------------------
# the shipped recipe, validated offline on a tiny MoE whose tokenizer carries the Thinking-style template
# ---------------------------------------------------------------------------------------------------------------


def test_thinking_function_call_recipe_validates_on_tiny_model(tmp_path, capsys, ernie_tokenizer_dir):
    if not ERNIEKIT_FC.is_file():
        missing(str(ERNIEKIT_FC), SHARED_HOW)
    from transformers import AutoTokenizer

    from erniekit_lite.cli import main
    from erniekit_lite.data.prepare import prepare
    from erniekit_lite.model.load import load_tokenizer
    from erniekit_lite.recipe import load
    from erniekit_lite.tiny import write_tiny

    model_dir = write_tiny(str(tmp_path / "tiny-thinking"), "moe", str(ernie_tokenizer_dir), hidden_size=64, layers=3)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": CONTROL})
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(model_dir)

    overrides = [f"model.path={model_dir}", f"data.train.0.path={ERNIEKIT_FC}", "train.bf16=false"]
    code = main(["validate", str(RECIPE), *overrides])
    out, err = capsys.readouterr()
    assert code == 0, err
    # the released template drops earlier reasoning: multi-turn records become one sample per trained turn
    assert "template model" in out and "227 records -> 905 samples" in out
    assert "each trained assistant turn of 193 multi-turn conversations is its own sample" in out
    assert "Ernie4_5_MoeForCausalLM" in out and "LoRA r=32" in out

    # what validate planned: the model's template, loss on exactly the assistant turns (tool calls included)
    recipe = load(RECIPE, overrides)
    tokenizer = load_tokenizer(str(model_dir))
    data = prepare(recipe.data, tokenizer, log=lambda *_: None)
    assert data.template == "model" and len(data.train.samples) == 905
    first = template_for(tokenizer).expand(to_conversation(read_records(str(ERNIEKIT_FC))[0], "messages"))[0]
    pieces = [p for turn in template_for(tokenizer).pieces(first) for p in turn]
    sample = data.train.samples[0]
    trained = tokenizer.decode([t for t in sample.labels if t != X])
    assert trained == "".join(p.text for p in pieces if p.trained)
    assert trained.startswith("Alright, the user asked for the current stock price of Apple.")  # <think>\n ends the prompt
    assert '<tool_call>\n{"name": "get_stock_price", "arguments": {"company": "Apple"}}\n</tool_call>\n<|im_end|>' in trained
    assert "<tool_output>" not in trained and "Hi, can you tell me" not in trained


def test_the_released_template_always_appends_the_prompt_and_is_repaired_for_training_only(thinking_tokenizer):
    """The released template emits `<|im_start|>assistant\n<think>\n` after its message loop whatever
    add_generation_prompt says; training wraps exactly that expression in the flag (the template has earlier endfors:
    the repair once swallowed the loop and failed silently). Inference renders as before; a finished conversation no
    longer ends in a prompt."""
    template = template_for(thinking_tokenizer)
    tail = '{{- "<|im_start|>assistant\n<think>\n"}}'
    assert isinstance(template, ModelTemplate) and THINKING_TEMPLATE.endswith("{%- endfor %}\n " + tail)
    assert template.chat_template == THINKING_TEMPLATE.replace(tail, "{%- if add_generation_prompt %}" + tail + "{%- endif %}")
    head = "<|im_start|>system\n<global_setting>\nthink_mode=True\n</global_setting><|im_end|>\n\n"
    messages = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>r1</think>a1"}, {"role": "user", "content": "q2"}]
    render = lambda m, flag, t=None: thinking_tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=flag, chat_template=t)
    assert render(messages, True) == render(messages, True, template.chat_template)
    answered = head + "<|im_start|>user\nq1<|im_end|>\n\n<|im_start|>assistant\n<think>\nr1\n</think>\n<response>\na1\n</response>\n<|im_end|>\n\n"
    assert render(messages[:2], False) == answered + GENERATION_PROMPT and render(messages[:2], False, template.chat_template) == answered
    # once q2 follows, a1 loses its reasoning: each turn is its own sample, its prompt what inference feeds the model
    conv = Conversation([Turn("q1", "<think>r1</think>a1"), Turn("q2", "a2")])
    parts = template.expand(conv)
    assert len(parts) == 2
    texts = [["".join(p.text for turn in template.pieces(part) for p in turn if p.trained == t) for t in (False, True)] for part in parts]
    first = head + "<|im_start|>user\nq1<|im_end|>\n\n" + GENERATION_PROMPT
    second = (head + "<|im_start|>user\nq1<|im_end|>\n\n<|im_start|>assistant\n<response>\na1\n</response>\n<|im_end|>\n\n"
              "<|im_start|>user\nq2<|im_end|>\n\n" + GENERATION_PROMPT)
    assert texts == [[first, "r1\n</think>\n<response>\na1\n</response>\n<|im_end|>\n\n"],
                     [second, "\n</think>\n<response>\na2\n</response>\n<|im_end|>\n\n"]]
    assert second == render(messages, True)
    assert "".join(p.text for p in template.generation_prompt(None, conv.turns[:1], "q2")) == second
