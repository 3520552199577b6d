"""Reading records from .json / .jsonl / .csv / .parquet with the file:line every error message points at."""

from __future__ import annotations

import json

import pytest
from conftest import TEST_EXTRA, need_module

from erniekit_lite.data.formats import check_format, detect_format, to_conversation
from erniekit_lite.data.load import Record, _looks_like_hub_id, read_records
from erniekit_lite.errors import DataError, UserError


def write(path, text: str, encoding: str = "utf-8"):
    path.write_text(text, encoding=encoding)
    return str(path)


def lines_of(records):
    return [r.line for r in records]


# ---------------------------------------------------------------------------------------------------------------
# JSON Lines
# ---------------------------------------------------------------------------------------------------------------


def test_jsonl_records_keep_their_line_and_skip_blank_lines(tmp_path):
    p = write(
        tmp_path / "d.jsonl",
        '{"src": ["q1"], "tgt": ["a1"]}\n\n   \n{"src": ["q2"], "tgt": ["a2"]}\r\n{"instruction": "i", "output": "o"}',
    )
    records = read_records(p)
    assert [r.data for r in records] == [{"src": ["q1"], "tgt": ["a1"]}, {"src": ["q2"], "tgt": ["a2"]}, {"instruction": "i", "output": "o"}]
    assert lines_of(records) == [1, 4, 5]
    assert all(r.path == p for r in records)
    assert records[1] == Record({"src": ["q2"], "tgt": ["a2"]}, p, 4)


def test_jsonl_malformed_line_3(tmp_path):
    p = write(tmp_path / "bad.jsonl", '{"src": ["a"], "tgt": ["b"]}\n{"src": ["c"], "tgt": ["d"]}\n{"src": ["e"], "tgt": \n')
    with pytest.raises(DataError) as e:
        read_records(p)
    assert str(e.value).startswith(f"{p}:3: malformed JSON line: Expecting value (column 23)")
    assert e.value.line == 3 and e.value.path == p
    assert isinstance(e.value, UserError)


def test_jsonl_record_not_an_object_reports_its_line(tmp_path):
    p = write(tmp_path / "d.jsonl", '{"src": ["a"], "tgt": ["b"]}\n["a", "b"]\n')
    records = read_records(p)
    with pytest.raises(DataError, match=rf"^{p}:2: expected a JSON object per record, got list$"):
        detect_format(records[1])


def test_jsonl_with_utf8_bom(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"src": ["q"], "tgt": ["\xe4\xbd\xa0\xe5\xa5\xbd"]}\n')
    (record,) = read_records(str(p))
    assert record.data == {"src": ["q"], "tgt": ["你好"]} and record.line == 1


def test_max_samples(tmp_path):
    p = write(tmp_path / "d.jsonl", "".join(json.dumps({"src": [f"q{i}"], "tgt": ["a"]}) + "\n" for i in range(5)))
    assert [r.data["src"] for r in read_records(p, max_samples=2)] == [["q0"], ["q1"]]
    assert len(read_records(p, max_samples=None)) == 5
    assert len(read_records(p, max_samples=50)) == 5


# ---------------------------------------------------------------------------------------------------------------
# JSON arrays
# ---------------------------------------------------------------------------------------------------------------

ALPACA_ARRAY = """[
  {
    "instruction": "First",
    "input": "",
    "output": "one"
  },
  {
    "instruction": "Second",
    "input": "multi\\nline {braces} [brackets]"
  },
  {"instruction": "Third", "output": "three"}, {"instruction": "Fourth", "output": "four"}
]
"""


def test_json_array_records_keep_their_starting_line(tmp_path):
    p = write(tmp_path / "d.json", ALPACA_ARRAY)
    records = read_records(p)
    assert lines_of(records) == [2, 7, 11, 11]
    assert records[1].data == {"instruction": "Second", "input": "multi\nline {braces} [brackets]"}
    assert [r.data["instruction"] for r in records] == ["First", "Second", "Third", "Fourth"]


def test_json_array_second_record_missing_output(tmp_path):
    p = write(tmp_path / "d.json", ALPACA_ARRAY)
    records = read_records(p)
    fmt = detect_format(records[0])
    assert fmt == "alpaca"
    check_format(records[0], fmt)
    with pytest.raises(DataError) as e:
        check_format(records[1], fmt)
    assert str(e.value) == f"{p}:7: missing field 'output' (alpaca format)"
    with pytest.raises(DataError) as e:
        to_conversation(records[1], fmt)
    assert str(e.value) == f"{p}:7: missing field 'output'"


def test_json_array_record_not_an_object(tmp_path):
    p = write(tmp_path / "d.json", '[\n  {"instruction": "a", "output": "b"},\n  "just text"\n]')
    records = read_records(p)
    assert lines_of(records) == [2, 3]
    with pytest.raises(DataError, match=rf"^{p}:3: expected a JSON object per record, got str$"):
        to_conversation(records[1], "alpaca")


def test_json_malformed_reports_the_line(tmp_path):
    p = write(tmp_path / "d.json", '[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "c",\n   "output": }\n]')
    with pytest.raises(DataError, match=rf"^{p}:4: malformed JSON: Expecting value"):
        read_records(p)
    p = write(tmp_path / "e.json", '[\n  {"instruction": "a", "output": "b"}\n  {"instruction": "c", "output": "d"}\n]')
    with pytest.raises(DataError, match=rf"^{p}:3: malformed JSON: expected ',' or '\]' between records \(column 3\)$"):
        read_records(p)


def test_json_truncated_array_is_an_error(tmp_path):
    p = write(tmp_path / "d.json", '[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "c", "output": "d"}\n')
    with pytest.raises(DataError, match=rf"^{p}:4: malformed JSON: unterminated array"):
        read_records(p)
    p = write(tmp_path / "e.json", '[\n  {"instruction": "a", "output": "b"},\n')
    with pytest.raises(DataError, match=rf"^{p}:3: malformed JSON: unterminated array"):
        read_records(p)


def test_json_content_after_array_is_an_error(tmp_path):
    p = write(tmp_path / "d.json", '[{"instruction": "a", "output": "b"}]\n[{"instruction": "c", "output": "d"}]\n')
    with pytest.raises(DataError, match=rf"^{p}:2: malformed JSON: unexpected content after the closing '\]'"):
        read_records(p)


def test_json_empty_array_and_not_an_array(tmp_path):
    assert read_records(write(tmp_path / "empty.json", " [ ]\n\n")) == []
    p = write(tmp_path / "num.json", "\n\n42")
    with pytest.raises(DataError, match=rf"^{p}:3: expected a JSON array of records$"):
        read_records(p)
    p = write(tmp_path / "blank.json", "  \n")
    with pytest.raises(DataError, match=rf"^{p}:2: expected a JSON array of records$"):
        read_records(p)


def test_json_single_object_and_json_lines_saved_as_json(tmp_path):
    (single,) = read_records(write(tmp_path / "one.json", '\n{"src": ["q"],\n "tgt": ["a"]}\n'))
    assert single.data == {"src": ["q"], "tgt": ["a"]} and single.line == 2
    records = read_records(write(tmp_path / "lines.json", '{"src": ["q1"],\n "tgt": ["a1"]}\n\n{"src": ["q2"], "tgt": ["a2"]}\n{"src": ["q3"], "tgt": ["a3"]}\n'))
    assert lines_of(records) == [1, 4, 5]
    assert [r.data["src"] for r in records] == [["q1"], ["q2"], ["q3"]]


def test_json_with_utf8_bom(tmp_path):
    p = tmp_path / "bom.json"
    p.write_bytes(b'\xef\xbb\xbf[\n {"instruction": "a", "output": "b"}\n]\n')
    (record,) = read_records(str(p))
    assert record.data == {"instruction": "a", "output": "b"} and record.line == 2


def test_uppercase_extension(tmp_path):
    (record,) = read_records(write(tmp_path / "D.JSON", '[{"instruction": "a", "output": "b"}]'))
    assert record.data == {"instruction": "a", "output": "b"}


# ---------------------------------------------------------------------------------------------------------------
# paths
# ---------------------------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    p = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=rf"^{p}: file not found"):
        read_records(p)


def test_missing_relative_file_with_data_extension_is_not_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for p in ("data/train.jsonl", "data/train.json", "out/train.CSV", "x/y.parquet"):
        with pytest.raises(DataError, match=rf"^{p}: file not found"):
            read_records(p)


def test_directory(tmp_path):
    with pytest.raises(DataError, match=rf"^{tmp_path}: is a directory; expected a .json, .jsonl, .parquet or .csv file$"):
        read_records(str(tmp_path))


def test_unsupported_extension(tmp_path):
    p = write(tmp_path / "d.txt", "hello")
    with pytest.raises(DataError, match=rf"^{p}: unsupported file type '.txt'; expected .json, .jsonl, .parquet or .csv$"):
        read_records(p)


def test_hub_id_detection():
    assert _looks_like_hub_id("tatsu-lab/alpaca")
    assert _looks_like_hub_id("org/name.v2")
    assert not _looks_like_hub_id("alpaca")
    assert not _looks_like_hub_id("./org/name")
    assert not _looks_like_hub_id("~/name")
    assert not _looks_like_hub_id("a/b/c")
    assert not _looks_like_hub_id("data.v1/name")


# ---------------------------------------------------------------------------------------------------------------
# CSV
# ---------------------------------------------------------------------------------------------------------------


def test_csv_with_pandas_multiline_cells_numbers_and_empty_cells(tmp_path):
    pd = need_module("pandas", TEST_EXTRA)
    p = str(tmp_path / "d.csv")
    pd.DataFrame(
        {
            "instruction": ["Sum?", "Write two lines.", "Say hi"],
            "input": ["2 2", "", ""],
            "output": ["4", "line 1\nline 2", "hi, \"you\""],
        }
    ).to_csv(p, index=False)
    records = read_records(p)
    assert [r.data for r in records] == [
        {"instruction": "Sum?", "input": "2 2", "output": "4"},  # a number-looking cell stays text
        {"instruction": "Write two lines.", "input": None, "output": "line 1\nline 2"},
        {"instruction": "Say hi", "input": None, "output": 'hi, "you"'},
    ]
    assert lines_of(records) == [2, 3, 5]  # the second record spans lines 3-4
    convs = [to_conversation(r, detect_format(r)) for r in records]
    assert [(c.turns[0].user, c.turns[0].assistant) for c in convs] == [
        ("Sum?\n2 2", "4"),
        ("Write two lines.", "line 1\nline 2"),
        ("Say hi", 'hi, "you"'),
    ]


def test_csv_all_numeric_column_stays_text(tmp_path):
    p = write(tmp_path / "d.csv", "instruction,output\nWhat is 2+2?,4\nWhat is 3+3?,6\n")
    records = read_records(p)
    assert [r.data for r in records] == [{"instruction": "What is 2+2?", "output": "4"}, {"instruction": "What is 3+3?", "output": "6"}]
    assert to_conversation(records[0], "alpaca").turns[0].assistant == "4"


def test_csv_errors_name_the_line(tmp_path):
    p = write(tmp_path / "d.csv", "instruction,output\na,b\n\nc,d,e\n")
    with pytest.raises(DataError, match=rf"^{p}:4: row has 3 fields but the header has 2$"):
        read_records(p)
    p = write(tmp_path / "e.csv", "instruction,output\na,b\nc\n")
    with pytest.raises(DataError, match=rf"^{p}:3: row has 1 fields but the header has 2$"):
        read_records(p)
    p = write(tmp_path / "f.csv", "instruction\nonly\n")
    (record,) = read_records(p)
    with pytest.raises(DataError, match=rf"^{p}:2: missing field 'output'$"):
        to_conversation(record, detect_format(record))


def test_csv_header_only_bom_and_blank_lines(tmp_path):
    assert read_records(write(tmp_path / "h.csv", "instruction,output\n")) == []
    assert read_records(write(tmp_path / "empty.csv", "")) == []
    p = tmp_path / "bom.csv"
    p.write_bytes(b"\xef\xbb\xbfinstruction,output\r\n\r\nq,a\r\n")
    (record,) = read_records(str(p))
    assert record.data == {"instruction": "q", "output": "a"} and record.line == 3


# ---------------------------------------------------------------------------------------------------------------
# Parquet
# ---------------------------------------------------------------------------------------------------------------


def test_parquet_records(tmp_path):
    pd = need_module("pandas", TEST_EXTRA)
    need_module("pyarrow", TEST_EXTRA)
    p = str(tmp_path / "d.parquet")
    pd.DataFrame(
        {
            "system": ["S", None],
            "src": [["q1", "q2"], ["only"]],
            "tgt": [["a1", "a2"], ["answer"]],
            "label": [[0, 1], [1]],
        }
    ).to_parquet(p, index=False)
    records = read_records(p)
    assert [r.data for r in records] == [
        {"system": "S", "src": ["q1", "q2"], "tgt": ["a1", "a2"], "label": [0, 1]},
        {"system": None, "src": ["only"], "tgt": ["answer"], "label": [1]},
    ]
    assert lines_of(records) == [1, 2] and all(r.path == p for r in records)
    convs = [to_conversation(r, detect_format(r)) for r in records]
    assert [(t.user, t.assistant, t.train) for t in convs[0].turns] == [("q1", "a1", False), ("q2", "a2", True)]
    assert convs[0].system == "S" and convs[1].system is None


def test_parquet_unreadable(tmp_path):
    p = write(tmp_path / "bad.parquet", "not parquet at all")
    with pytest.raises(DataError, match=rf"^{p}: could not read parquet file"):
        read_records(p)


# ---------------------------------------------------------------------------------------------------------------
# model.path that is no local directory (erniekit_lite/model/load.py): one line, one look at the Hub, no retries
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def hub_endpoint(monkeypatch):
    """Point huggingface_hub at `url` with the Hub switched on, whatever the environment says."""
    import huggingface_hub.constants

    def point(url: str, token: str | None = None) -> None:
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url)
        monkeypatch.setenv("HF_TOKEN", token or "unused")

    return point


@pytest.mark.parametrize("path", ["/nonexistent/model", "./nope", "../nope/model", "~/nope/model"])
def test_a_path_that_is_no_directory_and_no_hub_id_is_one_line(tmp_path, monkeypatch, hub_endpoint, path):
    """Not huggingface_hub's "Repo id must be in the form 'repo_name' or 'namespace/repo_name'": both facts, and
    nothing asked of the Hub (the endpoint here refuses connections)."""
    from erniekit_lite.model.load import load_model, load_tokenizer
    from erniekit_lite.model.source import missing_source

    monkeypatch.chdir(tmp_path)
    hub_endpoint("http://127.0.0.1:1")
    expected = f"model.path: {path}: no such directory here, and not a valid Hugging Face Hub repo id (ORG/NAME)"
    for load in (load_tokenizer, load_model):
        with pytest.raises(UserError) as e:
            load(path)
        assert str(e.value) == expected
    # what plan.py's config read gets back from transformers says the same
    repo_id_error = OSError(f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{path}'. Use `repo_type` argument if needed.")
    assert missing_source(path, repo_id_error) == expected


def test_a_hub_id_the_hub_does_not_have_is_one_line_after_one_request(tmp_path, monkeypatch, hub_endpoint):
    from fake_hub import FakeHub, Repo

    from erniekit_lite.model.load import load_tokenizer

    from erniekit_lite.model.source import check_source

    monkeypatch.chdir(tmp_path)
    with FakeHub("hf_test") as hub:
        hub_endpoint(hub.url, "hf_test")
        with pytest.raises(UserError) as e:
            load_tokenizer("nobody/nothing")
        assert str(e.value) == ("model.path: nobody/nothing: no such directory here, and the Hugging Face Hub has no such repo "
                                "(a private one needs `hf auth login`)")
        assert hub.calls == [("repo_info", "/api/models/nobody/nothing")]
        hub.repos["somebody/something"] = Repo(private=False)
        check_source("somebody/something")  # a repo the Hub has: left to from_pretrained
        hub.fail("repo_info", 503)
        check_source("nobody/nothing")  # an answer that says nothing about the repo: left to the download's retries
        assert hub.count("repo_info") == 3


def test_an_unreachable_hub_is_one_line_without_retries(tmp_path, monkeypatch, capfd, caplog, hub_endpoint):
    """Without network (here: a port that refuses connections) and HF_HUB_OFFLINE unset, from_pretrained would retry
    each file five times (`Retrying in 1s [Retry 1/5]` ... about 23 s per file) before failing; one request answers."""
    import time

    from erniekit_lite.model.load import load_tokenizer

    monkeypatch.chdir(tmp_path)
    hub_endpoint("http://127.0.0.1:1")
    started = time.monotonic()
    with pytest.raises(UserError) as e:
        load_tokenizer("runs/tiny-ernie")
    assert time.monotonic() - started < 5
    assert str(e.value) == ("model.path: runs/tiny-ernie: no such directory here, and the Hugging Face Hub could not be reached "
                            "to look for a repo of that name; the quick start's tiny model is made by "
                            "`erniekit-lite tiny runs/tiny-ernie --arch dense`")
    said = capfd.readouterr()
    assert "Retr" not in said.out + said.err + caplog.text


def test_a_model_folder_without_a_tokenizer_says_which_files_it_needs(tmp_path):
    """`train`, `chat` and `eval` load the tokenizer first: a folder with only the release's config.json, or with
    tokenizer_config.json but no vocabulary, is one whole line naming the files (transformers blamed a missing
    sentencepiece, and its message was cut after "from one of: "). The configs here are stand-ins: loading stops
    before they are read."""
    from erniekit_lite.model.load import load_tokenizer

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "ernie4_5"}')
    whole = ("`validate` needs only config.json for its memory plan, the tokenizer (tokenizer.model, tokenizer_config.json, "
             "added_tokens.json and special_tokens_map.json as released, or a tokenizer.json) to read the data, and "
             "`train` the weights (*.safetensors) too")
    with pytest.raises(UserError) as e:
        load_tokenizer(str(folder))
    assert str(e.value) == f"{folder}: no tokenizer in this folder; {whole}"
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    with pytest.raises(UserError) as e:
        load_tokenizer(str(folder))
    assert str(e.value) == f"{folder}: an incomplete tokenizer in this folder, no tokenizer.model or tokenizer.json; {whole}"


def test_a_library_error_over_several_lines_is_kept_whole_on_one():
    from erniekit_lite.model.source import one_line

    error = ValueError("Couldn't instantiate the backend tokenizer from one of: \n(1) a `tokenizers` library "
                       "serialization file, \n(2) a slow tokenizer instance to convert.\n")
    assert one_line(error) == ("Couldn't instantiate the backend tokenizer from one of: (1) a `tokenizers` library "
                               "serialization file, (2) a slow tokenizer instance to convert.")
    assert one_line(OSError()) == "OSError"
