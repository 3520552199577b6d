"""Web UI chat: streamed answers end in exactly the template's greedy answer; a failing generation ends the stream
with its error; the compared model defaults to what a run was trained from; Gradio's messages become history."""

from __future__ import annotations

import json

import pytest

import erniekit_lite.generate
from erniekit_lite import recipe as recipes
from erniekit_lite.data.formats import Turn
from erniekit_lite.errors import UserError
from erniekit_lite.webui.chat_tab import base_of, stream, turns


def test_stream_grows_to_the_greedy_answer(tiny_own_dir):
    from erniekit_lite.chat import load

    model, tokenizer = load(str(tiny_own_dir))
    history = [Turn("Hi", "Hello")]
    expected = erniekit_lite.generate.answer(model, tokenizer, "Who are you?", system="S", history=history, max_new_tokens=12)
    pieces = list(stream(model, tokenizer, "Who are you?", "S", history, {"max_new_tokens": 12, "do_sample": False}))
    assert pieces[-1] == expected and len(pieces) > 2
    assert all(later.startswith(earlier) for earlier, later in zip(pieces, pieces[1:]))


def test_an_image_goes_to_a_vl_model_and_is_refused_for_a_text_model(tiny_vl_dir, tiny_own_dir, tmp_path):
    """The chat tab's image: streamed to an ERNIE-4.5-VL model, the answer ends in exactly `chat --image`'s greedy one;
    a text model refuses it in one line (the tab shows it in the status box)."""
    from PIL import Image

    from erniekit_lite.chat import image_processor_of, load
    from erniekit_lite.data.vl import Image as Picture

    picture = tmp_path / "red.png"
    Image.new("RGB", (56, 56), (220, 30, 30)).save(picture)
    model, tokenizer = load(str(tiny_vl_dir))
    processor = image_processor_of(model, str(tiny_vl_dir))
    sampling = {"max_new_tokens": 8, "do_sample": False}
    expected = erniekit_lite.generate.image_answer(model, tokenizer, processor, [Picture(picture), "Colour?"], **sampling)
    pieces = list(stream(model, tokenizer, "Colour?", None, [], sampling, str(picture), processor))
    assert pieces[-1] == expected
    text_model, text_tokenizer = load(str(tiny_own_dir))
    assert image_processor_of(text_model, str(tiny_own_dir)) is None
    with pytest.raises(UserError, match="this model reads text only"):
        list(stream(text_model, text_tokenizer, "q", None, [], sampling, str(picture), None))


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
