"""Web UI data preview: records rendered through the training pipeline, trained tokens highlighted, HTML escaped;
a bad record of any method is its file:line and field."""

from __future__ import annotations

import json

import pytest

from erniekit_lite import recipe as recipes
from erniekit_lite.webui.preview import render


def recipe(tmp_path, model_dir, records: list[dict], **data) -> recipes.Recipe:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return recipes.from_dict({"model": {"path": str(model_dir)}, "data": {"train": [str(path)], **data},
                              "output": {"dir": str(tmp_path / "out")}})


def test_trained_tokens_are_marked_and_text_is_escaped(tmp_path, tiny_own_dir):
    records = [{"src": ["Hi <b>there</b> & <script>x</script>", "And now?"], "tgt": ["Hello!", "Bye."], "label": [0, 1]},
               {"src": ["second"], "tgt": ["2"]}]
    html = render(recipe(tmp_path, tiny_own_dir, records, system="Be <brief>."), records=1)
    assert html.count("<b>sample") == 1  # only the first record
    assert "<script>" not in html and "&lt;script&gt;x&lt;/script&gt;" in html
    assert "&lt;|begin_of_sentence|&gt;Be &lt;brief&gt;.\nUser: Hi &lt;b&gt;there&lt;/b&gt; &amp; &lt;script&gt;" in html
    # label 0 masks the first answer: only the second one and its end-of-turn token are trained
    second_turn = "User: And now?\nAssistant: <mark>Bye.&lt;|end_of_sentence|&gt;</mark>"
    assert f"Assistant: Hello!&lt;|end_of_sentence|&gt;{second_turn}" in html
    assert html.count("<mark>") == 1


def test_preference_pairs_show_both_sides(tmp_path, tiny_own_dir):
    records = [{"prompt": "Who are you?", "chosen": "Wenxin-Tiny.", "rejected": "ChatGPT."}]
    html = render(recipe(tmp_path, tiny_own_dir, records).model_copy(update={"method": "dpo"}))
    assert "pair 1, chosen" in html and "pair 1, rejected" in html
    for answer in ("Wenxin-Tiny.", "ChatGPT."):
        assert f"<mark>{answer}&lt;|end_of_sentence|&gt;</mark>" in html


def test_pretraining_pieces_show_every_token_but_the_first_trained(tmp_path, tiny_own_dir):
    records = [{"text": "Raw <i>domain</i> text"}, {"text": "second"}]
    r = recipe(tmp_path, tiny_own_dir, records).model_copy(update={"method": "pt"})
    html = render(r, records=1)
    assert html.count("<b>piece") == 1
    # no chat template: the document's own text, then </s>; all but its first token highlighted
    assert "R<mark>aw &lt;i&gt;domain&lt;/i&gt; text&lt;/s&gt;</mark>" in html.replace("</mark><mark>", "")


def test_grpo_prompts_show_the_generation_prompt_and_the_reference(tmp_path, tiny_own_dir):
    records = [{"question": "What is <b>2</b> + 9?", "answer": "2 + 9 = 11\n#### 11"}, {"question": "Hi", "answer": "#### 5"}]
    html = render(recipe(tmp_path, tiny_own_dir, records).model_copy(update={"method": "grpo"}), records=2)
    assert "prompt 1, reference answer: 2 + 9 = 11\n#### 11" in html and "prompt 2, reference answer: #### 5" in html
    # the prompt as generation renders it, ending where the completion starts; nothing is trained in it
    assert "&lt;|begin_of_sentence|&gt;User: What is &lt;b&gt;2&lt;/b&gt; + 9?\nAssistant: </div>" in html
    assert "<mark>" not in html and "0 trained" in html


def test_kto_examples_show_their_label_and_reward_pairs_both_sides(tmp_path, tiny_own_dir):
    records = [{"prompt": "Who are you?", "completion": "Wenxin-Tiny.", "label": True},
               {"prompt": "Who are you?", "completion": "ChatGPT.", "label": False}]
    html = render(recipe(tmp_path, tiny_own_dir, records).model_copy(update={"method": "kto"}), records=2)
    assert "example 1, desirable" in html and "example 2, undesirable" in html
    assert "<mark>Wenxin-Tiny.&lt;|end_of_sentence|&gt;</mark>" in html
    pairs = [{"prompt": "Who are you?", "chosen": "Wenxin-Tiny.", "rejected": "ChatGPT."}]
    for method in ("orpo", "simpo", "rm"):
        html = render(recipe(tmp_path, tiny_own_dir, pairs).model_copy(update={"method": method}))
        assert "pair 1, chosen" in html and "pair 1, rejected" in html


@pytest.mark.parametrize(("method", "bad", "message"), [
    ("kto", {"prompt": "a", "completion": "c", "label": "maybe"},
     "field 'label' must be true (desirable) or false (undesirable), got 'maybe'"),
    ("pt", {"text": 5}, "'text' must be a string (got int)"),
    ("dpo", {"prompt": "a", "chosen": "b"}, "missing field 'rejected'"),
    ("orpo", {"prompt": "a", "chosen": "b"}, "missing field 'rejected'"),
    ("simpo", {"prompt": "a", "chosen": "b"}, "missing field 'rejected'"),
    ("rm", {"prompt": "a", "chosen": "b", "rejected": ["x"]}, "rejected[0] must be an object with 'role' and 'content'"),
])
def test_a_bad_record_is_its_file_line_and_field_for_every_method(tmp_path, tiny_own_dir, method, bad, message):
    """The preview reads records as training does: the first bad one stops it with FILE:LINE and the field."""
    from erniekit_lite.errors import DataError

    good = {"kto": {"prompt": "a", "completion": "b", "label": True}, "pt": {"text": "ok"}}.get(
        method, {"prompt": "a", "chosen": "b", "rejected": "c"})
    with pytest.raises(DataError) as e:
        render(recipe(tmp_path, tiny_own_dir, [good, bad]).model_copy(update={"method": method}), log=lambda line: None)
    assert str(e.value) == f"{tmp_path / 'data.jsonl'}:2: {message}"
