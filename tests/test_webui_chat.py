"""Web UI chat: streamed answers end in exactly the template's greedy answer; a failing generation ends the stream
with its error; the compared model defaults to what a run was trained from; Gradio's messages become history."""

from __future__ import annotations

import json

import pytest

import erniekit_lite.generate
from erniekit_lite import recipe as recipes
from erniekit_lite.data.formats import Turn
from erniekit_lite.webui.chat_tab import base_of, stream, turns


def test_stream_grows_to_the_greedy_answer(tiny_own_dir):
    from erniekit_lite.chat import load

    model, tokenizer = load(str(tiny_own_dir))
    history = [Turn("Hi", "Hello")]
    expected = erniekit_lite.generate.answer(model, tokenizer, "Who are you?", system="S", history=history, max_new_tokens=12)
    pieces = list(stream(model, tokenizer, "Who are you?", "S", history, {"max_new_tokens": 12, "do_sample": False}))
    assert pieces[-1] == expected and len(pieces) > 2
    assert all(later.startswith(earlier) for earlier, later in zip(pieces, pieces[1:]))


def test_a_failing_generation_ends_the_stream(monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(erniekit_lite.generate, "answer", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        list(stream(None, None, "q", None, [], {}))


def test_the_compared_model_is_what_the_run_started_from(tmp_path):
    adapter = tmp_path / "lora-run"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "runs/base"}))
    full = tmp_path / "full-run"
    full.mkdir()
    run = recipes.from_dict({"model": {"path": "runs/tiny"}, "data": {"train": ["d.jsonl"]}, "output": {"dir": str(full)}})
    (full / "recipe.yaml").write_text(run.to_yaml())
    assert (base_of(str(adapter)), base_of(str(full)), base_of(str(tmp_path))) == ("runs/base", "runs/tiny", "")


def test_gradio_messages_become_history():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}]}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": [{"type": "text", "text": "d"}]}]
    assert turns(messages) == [Turn("a", "b"), Turn("c", "d")]
