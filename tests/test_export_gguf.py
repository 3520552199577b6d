"""`erniekit-lite export --to gguf` through llama.cpp's own converter and loaded by llama.cpp itself
(`llama-cpp-python`): greedy answers from the same prompt ids equal transformers', token for token; ERNIE's chat
markers are control tokens in the GGUF; the Ollama Modelfile's template renders conversations as erniekit-lite
does, and llama.cpp tokenizes that text (its default BOS handling, control tokens parsed) into training's prompt ids
for a single turn; the MTP tensors llama.cpp skips are counted. Needs `llama-cpp-python` (built from its source
distribution) and `LLAMA_CPP_DIR` pointing at llama.cpp's converter (the unpacked sdist: `.ci/run` sets both up);
the engine tests also need the shared ERNIE tokenizer (its sentencepiece `tokenizer.model`) and skip without it.
llama.cpp itself (decoding, tokenizing, the quantizer) runs in child processes (`helpers.in_child`, `export.quantize`):
an engine built for instructions this CPU lacks dies by SIGILL, which fails the test that ran it, not the run."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
from pathlib import Path

import pytest
from conftest import ERNIE_TOKENIZER_DIR, needs, needs_engine
from helpers import in_child, run_cli, visible_lora_run, write_recipe

from erniekit_lite.cli import main as run_cli_main
from erniekit_lite.data.formats import Turn
from erniekit_lite.data.template import template_for
from erniekit_lite.data.tokenize import Tokenizer
from erniekit_lite.export import OLLAMA_TEMPLATE, STOP
from erniekit_lite.generate import Prompt, _prompt_ids, stop_ids

CONVERTER = os.environ.get("LLAMA_CPP_DIR")
LLAMA_HOW = "build llama-cpp-python from its sdist and set LLAMA_CPP_DIR to it, as .ci/run does"
needs_converter = needs(CONVERTER, "llama.cpp's converter (LLAMA_CPP_DIR)", LLAMA_HOW)
needs_llama_cpp = needs_engine(lambda: CONVERTER and importlib.util.find_spec("llama_cpp") is not None,
                               "llama-cpp-python and llama.cpp's converter (LLAMA_CPP_DIR)", LLAMA_HOW)
TOKENS = 12
SYSTEM = "You are concise."  # dense_full_run's recipe data.system


def _agreement():
    """benchmarks/gguf_agreement.py: the greedy helpers the benchmark measures with, so both compare alike."""
    spec = importlib.util.spec_from_file_location("gguf_agreement", Path(__file__).resolve().parents[1] / "benchmarks" / "gguf_agreement.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


AGREEMENT = _agreement()
ENGINE = Path(__file__).with_name("llama_engine.py")
PROMPTS = AGREEMENT.PROMPTS[:5]


# The run fixtures request `ernie_tokenizer_dir` only to skip without ../shared: export needs the sentencepiece
# tokenizer.model, which is in the shared dir itself (the re-saved copy has tokenizer.json only)
@pytest.fixture(scope="module")
def dense_lora_run(tmp_path_factory, ernie_tokenizer_dir) -> Path:
    return visible_lora_run(tmp_path_factory.mktemp("gguf-dense"), "dense", ERNIE_TOKENIZER_DIR)


@pytest.fixture(scope="module")
def dense_full_run(tmp_path_factory, ernie_tokenizer_dir) -> Path:
    """Full fine-tuning saves tokenizer.json only: export finds tokenizer.model through the recipe's model. Its recipe
    has a system prompt, which `--ollama` puts in the Modelfile."""
    from erniekit_lite.tiny import write_tiny

    tmp = tmp_path_factory.mktemp("gguf-full")
    base = write_tiny(str(tmp / "base"), "dense", str(ERNIE_TOKENIZER_DIR), hidden_size=64, layers=2)
    recipe = write_recipe(tmp / "r.yaml", base, out=tmp / "run", data={"system": SYSTEM},
                          train={"learning_rate": 1e-2, "max_steps": 1, "per_device_train_batch_size": 2, "activation_checkpointing": False})
    assert run_cli_main(["train", str(recipe)]) == 0
    assert not (tmp / "run" / "tokenizer.model").exists()
    return tmp / "run"


@pytest.fixture(scope="module")
def moe_lora_run(tmp_path_factory, ernie_tokenizer_dir) -> Path:
    """3 layers (the first dense), 8 experts top-2, 2 shared; LoRA on every expert."""
    return visible_lora_run(tmp_path_factory.mktemp("gguf-moe"), "moe", ERNIE_TOKENIZER_DIR)


def transformers_greedy(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    return AGREEMENT.transformers_greedy(model_dir, PROMPTS, TOKENS)


def llama_greedy(gguf: Path, prompts: list[list[int]], stop: set[int]) -> list[list[int]]:
    return in_child(ENGINE, "greedy", str(gguf), prompts, sorted(stop), TOKENS)


def export_to(capsys, run: Path, out: Path, outtype: str, *extra) -> Path:
    code, printed, err = run_cli(capsys, "export", run, "--outtype", outtype, "--out", out, "--llama-cpp", CONVERTER, *extra)
    assert code == 0, err
    marker = json.loads((out / "erniekit_export.json").read_text())
    assert f"export: {out / marker['gguf']}" in printed
    return out / marker["gguf"]


@pytest.mark.slow
@needs_llama_cpp
@pytest.mark.parametrize("model", ["dense_lora_run", "moe_lora_run", "dense_full_run"])
def test_llama_cpp_greedy_equals_transformers(tmp_path, capsys, request, model):
    run = request.getfixturevalue(model)
    gguf = export_to(capsys, run, tmp_path / "f32", "f32")
    reference = run
    if model != "dense_full_run":
        reference = tmp_path / "merged"
        assert run_cli(capsys, "merge", run, "--out", reference)[0] == 0
    prompts, expected = transformers_greedy(reference)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reference)
    stop = {tokenizer.convert_tokens_to_ids(t) for t in STOP}
    got = llama_greedy(gguf, prompts, stop)
    assert got == expected
    assert sum(map(len, expected)) >= 3 * len(PROMPTS)  # answers long enough for the comparison to mean something

    # the chat markers are control tokens: llama.cpp reads a rendered prompt as training built its ids
    markers = ["<|begin_of_sentence|>", "<|end_of_sentence|>"]
    assert in_child(ENGINE, "tokenize", str(gguf), markers, True, False) == [[tokenizer.convert_tokens_to_ids(m)] for m in markers]
    assert len(in_child(ENGINE, "tokenize", str(gguf), markers[:1], False, False)[0]) > 1  # typed text stays text
    # the tokenizer's own behaviour, not llama.cpp's sentencepiece defaults (<s> first, a space after control tokens)
    metadata = in_child(ENGINE, "metadata", str(gguf))
    assert metadata["tokenizer.ggml.add_bos_token"] == "false" and metadata["tokenizer.ggml.add_space_prefix"] == "false"
    marked = json.loads((tmp_path / "f32" / "erniekit_export.json").read_text())["control_tokens_marked"]
    print(f"{model}: control tokens the converter left as text, marked: {marked}")


@pytest.mark.slow
@needs_llama_cpp
def test_f16_gguf_answers_close_to_transformers(tmp_path, capsys, dense_lora_run):
    """f16 rounds the weights, so greedy answers may part from transformers' late in an answer: at least 75% of the
    tokens agree before the first difference (docs/after-training.md)."""
    merged = tmp_path / "merged"
    assert run_cli(capsys, "merge", dense_lora_run, "--out", merged)[0] == 0
    prompts, expected = transformers_greedy(merged)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(merged)
    stop = {tokenizer.convert_tokens_to_ids(t) for t in STOP}
    same, prefix, total = AGREEMENT.agreement(expected, llama_greedy(export_to(capsys, dense_lora_run, tmp_path / "f16", "f16"), prompts, stop))
    assert prefix >= 0.75 * total, (same, prefix, total)


@pytest.fixture(scope="module")
def wide_lora_run(tmp_path_factory, ernie_tokenizer_dir) -> Path:
    """Hidden 256: every layer weight's rows hold whole 256-value K-quant superblocks, so q4_k_m quantizes them as
    Q4_K / Q6_K (at hidden 64 llama.cpp falls back to other types and the file is q8_0's size)."""
    return visible_lora_run(tmp_path_factory.mktemp("gguf-wide"), "dense", ERNIE_TOKENIZER_DIR, hidden_size=256)


@pytest.mark.slow
@needs_llama_cpp
def test_quantized_ggufs_hold_their_types_and_answer(tmp_path, capsys, wide_lora_run):
    """llama.cpp's quantizer ran as asked: with q8_0 every layer weight is Q8_0, and q8_0 answers as transformers does
    for at least half the tokens before the first difference (measured 67%: a random model's near-tied logits flip
    under 8-bit rounding); with q4_k_m the layer weights are Q4_K (some Q6_K, as
    llama.cpp's Q4_K_M mix keeps them) and the file is smaller than q8_0's. Its agreement with transformers is
    measured by benchmarks/gguf_agreement.py, not asserted. The intermediate f16 is not left behind."""
    merged = tmp_path / "merged"
    assert run_cli(capsys, "merge", wide_lora_run, "--out", merged)[0] == 0
    prompts, expected = transformers_greedy(merged)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(merged)
    stop = {tokenizer.convert_tokens_to_ids(t) for t in STOP}
    files = {}
    for outtype in ("q8_0", "q4_k_m"):
        files[outtype] = gguf = export_to(capsys, wide_lora_run, tmp_path / outtype, outtype)
        assert not list((tmp_path / outtype).glob("model-f16.gguf"))
        types = in_child(ENGINE, "tensor_types", str(gguf), CONVERTER)
        layer = {name: kind for name, kind in types.items() if name.startswith("blk.") and name.endswith(".weight")
                 and not name.endswith("norm.weight")}
        assert len(layer) == 2 * 7, sorted(types)  # 2 layers x q, k, v, o, gate, up, down
        got = llama_greedy(gguf, prompts, stop)
        assert len(got) == len(PROMPTS) and all(got)
        if outtype == "q8_0":
            assert set(layer.values()) == {"Q8_0"}, layer
            same, prefix, total = AGREEMENT.agreement(expected, got)
            assert prefix >= 0.5 * total, (same, prefix, total)
        else:
            assert set(layer.values()) <= {"Q4_K", "Q6_K"} and "Q4_K" in layer.values(), layer
    assert files["q4_k_m"].stat().st_size < files["q8_0"].stat().st_size


def render_go_template(template: str, messages: list[dict]) -> str:
    """The subset of Go's text/template the Modelfile uses: {{ range .Messages }}, {{ if eq .Role "x" }},
    {{ else if eq .Role "x" }}, {{ end }}, {{ .Content }}."""
    tokens = re.split(r"({{.*?}})", template)

    def run(i: int, message: dict | None, out: list[str], emit: bool) -> int:
        while i < len(tokens):
            t = tokens[i]
            if not t.startswith("{{"):
                if emit:
                    out.append(t)
                i += 1
                continue
            action = t[2:-2].strip()
            if action == "end" or action.startswith("else"):
                return i
            if action == ".Content":
                if emit:
                    out.append(message["content"])
                i += 1
            elif action == "range .Messages":
                start, end = i + 1, None
                for m in messages:
                    end = run(start, m, out, emit)
                if end is None:  # no messages: skip the body
                    end = run(start, None, [], False)
                i = end + 1
            elif action.startswith("if "):
                taken = False
                while True:
                    cond = re.fullmatch(r'(?:if|else if) eq \.Role "(\w+)"', action)
                    hit = not taken and (cond is None or message["role"] == cond.group(1))
                    i = run(i + 1, message, out, emit and hit)
                    taken = taken or hit
                    action = tokens[i][2:-2].strip()
                    if action == "end":
                        break
                i += 1
            else:
                raise ValueError(f"unsupported action {action!r}")
        return i

    out: list[str] = []
    run(0, None, out, True)
    return "".join(out)


def test_modelfile_renders_as_erniekit_lite(tmp_path, capsys, ernie_tokenizer):
    from erniekit_lite.export import modelfile

    text = modelfile("model-q8_0.gguf", "You are concise.")
    template = re.search(r'TEMPLATE """(.*?)"""', text, re.S).group(1)
    assert template == OLLAMA_TEMPLATE
    assert 'PARAMETER stop "</s>"' in text and 'PARAMETER stop "<|end_of_sentence|>"' in text
    assert 'SYSTEM """You are concise."""' in text and text.startswith("FROM ./model-q8_0.gguf\n")

    tok = Tokenizer(ernie_tokenizer, template_for(ernie_tokenizer))
    for system, history, user in ((None, [], "Who are you?"), ("You are concise.", [], "Hi"),
                                  ("Be brief.", [Turn("1 + 1?", "2"), Turn("And 2 + 2?", "4")], "And 3 + 3?")):
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [m for t in history for m in ({"role": "user", "content": t.user}, {"role": "assistant", "content": t.assistant})] + \
            [{"role": "user", "content": user}]
        pieces = tok.template.generation_prompt(system, history, user)
        expected = "".join(p.text if p.text is not None else ernie_tokenizer.decode(list(p.ids)) for p in pieces)
        assert render_go_template(OLLAMA_TEMPLATE, messages) == expected


@needs_converter
def test_bad_input_is_one_line(tmp_path, capsys, tiny_own_dir):
    def error(*argv) -> str:
        code, out, err = run_cli(capsys, "export", *argv)
        assert code == 2 and err.count("\n") == 1, err
        return err

    out = tmp_path / "out"
    assert "--outtype: 'q3'" in error(tiny_own_dir, "--out", out, "--outtype", "q3", "--llama-cpp", CONVERTER)
    assert "no convert_hf_to_gguf.py" in error(tiny_own_dir, "--out", out, "--llama-cpp", tmp_path)
    unfinished = tmp_path / "run"
    unfinished.mkdir()
    (unfinished / "recipe.yaml").write_text("model: {path: x}\n")
    assert "has not finished" in error(unfinished, "--out", out, "--llama-cpp", CONVERTER)
    assert "no sentencepiece tokenizer.model" in error(tiny_own_dir, "--out", out, "--llama-cpp", CONVERTER)
    assert not out.exists() and not list(tmp_path.glob(".out.exporting-*"))  # nothing half-written
    odd = tmp_path / "odd-moe"  # shared experts narrower than llama.cpp's converter assumes: refused before converting
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "ernie4_5_moe", "moe_num_shared_experts": 2, "moe_intermediate_size": 32,
                                                  "intermediate_size": 192, "num_key_value_heads": 1}))
    assert "shared experts 64 wide" in error(odd, "--out", out, "--llama-cpp", CONVERTER)
    assert not out.exists() and not list(tmp_path.glob(".out.exporting-*"))
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert "not empty" in error(tiny_own_dir, "--out", out, "--llama-cpp", CONVERTER)
    assert (out / "mine.txt").read_text() == "keep"


def transformers_greedy_from(model, tokenizer, ids: list[int]) -> list[int]:
    """transformers' greedy continuation of `ids` up to a stop token (as generate.greedy_ids, from given ids)."""
    import torch

    stop = stop_ids(model, tokenizer)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False, eos_token_id=stop,
                             pad_token_id=tokenizer.pad_token_id or 0)[0, len(ids):].tolist()
    return out[:next((k for k, t in enumerate(out) if t in stop), len(out))]


@pytest.mark.slow
@needs_llama_cpp
def test_ollama_export_prompts_read_by_llama_cpp_as_training(tmp_path, capsys, dense_full_run):
    """`export --ollama` end to end: the Modelfile beside the GGUF, FROM it, with the stop tokens and the recipe's
    system prompt. The text its template renders, tokenized by llama.cpp as a server does (its default BOS handling,
    control tokens parsed), is training's prompt ids for a single turn, and greedy answers from it equal
    transformers'. A multi-turn prompt is transformers' tokenization of the whole text: one token apart from
    training's per earlier answer that starts with a word (training tokenizes the answer apart from `Assistant: `)."""
    from erniekit_lite.chat import load

    out = tmp_path / "ollama"
    code, printed, err = run_cli(capsys, "export", dense_full_run, "--outtype", "f32", "--out", out, "--llama-cpp", CONVERTER, "--ollama")
    assert code == 0, err
    gguf = out / "model-f32.gguf"
    assert f"export: {gguf} and {out / 'Modelfile'}" in printed
    assert "leaves out" not in printed  # no MTP tensors in this checkpoint
    text = (out / "Modelfile").read_text(encoding="utf-8")
    source = re.match(r"FROM (\S+)\n", text).group(1)
    assert (out / source).resolve() == gguf.resolve()
    assert re.findall(r'PARAMETER stop "(.*?)"', text) == list(STOP)
    assert re.search(r'SYSTEM """(.*?)"""', text, re.S).group(1) == SYSTEM
    template = re.search(r'TEMPLATE """(.*?)"""', text, re.S).group(1)
    assert template == OLLAMA_TEMPLATE

    model, tokenizer = load(str(dense_full_run))
    training = Tokenizer(tokenizer, template_for(tokenizer))

    def rendered(system, history, user) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [m for t in history for m in ({"role": "user", "content": t.user}, {"role": "assistant", "content": t.assistant})] + \
            [{"role": "user", "content": user}]
        return render_go_template(template, messages)

    singles = ((SYSTEM, "Who are you?"), (SYSTEM, "写一句关于春天的诗。"), (None, "What is 2 + 2?"))
    history = [Turn("1 + 1?", "2"), Turn("And 2 + 2?", "Four, of course.")]
    whole = rendered(SYSTEM, history, "And 3 + 3?")
    # add_bos: llama.cpp's default, as a server tokenizes
    *prompts, ids = in_child(ENGINE, "tokenize", str(gguf), [rendered(system, [], user) for system, user in singles] + [whole], True)
    for (system, user), single in zip(singles, prompts):
        assert single == _prompt_ids(training, Prompt(user, system)), (system, user)
    assert ids == tokenizer(whole)["input_ids"]
    trained = _prompt_ids(training, Prompt("And 3 + 3?", SYSTEM, history))
    k = next(i for i, (a, b) in enumerate(zip(ids, trained)) if a != b)  # "2" is `▁ 2` either way; "Four" is not
    assert tokenizer.convert_ids_to_tokens(trained[k:k + 2]) == ["▁", "Four"] and tokenizer.convert_ids_to_tokens(ids[k]) == "▁Four"
    assert trained[k + 2:] == ids[k + 1:]
    prompts.append(ids)

    expected = [transformers_greedy_from(model, tokenizer, p) for p in prompts]
    stop = {tokenizer.convert_tokens_to_ids(t) for t in STOP}
    assert llama_greedy(gguf, prompts, stop) == expected
    assert sum(map(len, expected)) >= 2 * len(prompts)


@pytest.mark.slow
@needs_llama_cpp
def test_mtp_tensors_llama_cpp_skips_are_counted(tmp_path, capsys, ernie_tokenizer_dir):
    """A checkpoint laid out as the released 21B-A3B, with its MTP block (`model.mtp_*`): llama.cpp's converter skips
    those tensors; export says how many, and the GGUF loads and answers as transformers does (which skips them too)."""
    from test_merge_carry import released_layout_with_mtp

    from erniekit_lite.tiny import write_tiny

    tiny = write_tiny(str(tmp_path / "tiny"), "moe", str(ERNIE_TOKENIZER_DIR), hidden_size=64, layers=3)
    released = tmp_path / "released"
    mtp = released_layout_with_mtp(tiny, released)
    out = tmp_path / "gguf"
    code, printed, err = run_cli(capsys, "export", released, "--outtype", "f32", "--out", out, "--llama-cpp", CONVERTER)
    assert code == 0, err
    assert f"export: the GGUF leaves out {len(mtp)} multi-token-prediction tensor(s) of the checkpoint (model.mtp_*)" in printed
    assert json.loads((out / "erniekit_export.json").read_text())["tensors_left_out"] == len(mtp)
    prompts, expected = AGREEMENT.transformers_greedy(released, PROMPTS[:2], TOKENS)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(released)
    assert llama_greedy(out / "model-f32.gguf", prompts, {tokenizer.convert_tokens_to_ids(t) for t in STOP}) == expected


def test_no_converter_is_one_line(tmp_path, capsys, monkeypatch, tiny_own_dir):
    """Neither --llama-cpp nor $LLAMA_CPP_DIR: one line saying how to get llama.cpp's converter (needs no llama.cpp)."""
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    code, out, err = run_cli(capsys, "export", tiny_own_dir, "--out", tmp_path / "out")
    assert code == 2 and err.count("\n") == 1, err
    assert "export needs llama.cpp's converter: pass --llama-cpp DIR" in err and "LLAMA_CPP_DIR" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.exporting-*"))


def test_a_relative_llama_cpp_folder_runs_its_converter(tmp_path, monkeypatch):
    """`--llama-cpp` (or LLAMA_CPP_DIR) relative to where the command runs: the converter runs from its own folder,
    and its path was joined twice before (it always failed). A stand-in converter that writes its --outfile."""
    from erniekit_lite import export

    (tmp_path / "src" / "llama").mkdir(parents=True)
    (tmp_path / "src" / "llama" / "convert_hf_to_gguf.py").write_text(
        "import sys\nopen(sys.argv[sys.argv.index('--outfile') + 1], 'w').write('gguf')\n")
    (tmp_path / "model").mkdir()
    monkeypatch.chdir(tmp_path)
    for given in ("src/llama", "./src/../src/llama"):
        gguf = tmp_path / f"{len(given)}.gguf"
        export.convert(export.find_converter(given), Path("model"), gguf, "f16", lambda *_: None)
        assert gguf.read_text() == "gguf"


def test_engine_killed_by_a_signal_fails_only_its_test(tmp_path):
    """A stand-in engine that dies as llama.cpp's AMX kernels did on a CPU without them (SIGILL): `in_child` fails the
    calling test with the signal and the engine's last lines, and this process goes on."""
    engine = tmp_path / "engine.py"
    engine.write_text("import os, signal, sys\n"
                      "def crash():\n"
                      "    print('ggml_backend_amx_mul_mat: about to run', flush=True)\n"
                      "    print('tilezero %tmm4', file=sys.stderr, flush=True)\n"
                      "    os.kill(os.getpid(), signal.SIGILL)\n"
                      "def answer(x):\n"
                      "    return [x, x + 1]\n")
    with pytest.raises(pytest.fail.Exception) as failed:
        in_child(engine, "crash")
    message = str(failed.value)
    assert "crash (in a child process) was killed by SIGILL" in message
    assert "ggml_backend_amx_mul_mat: about to run" in message and "tilezero %tmm4" in message
    assert in_child(engine, "answer", 41) == [41, 42]  # the same helper, a healthy engine: its result


def test_quantizer_killed_by_a_signal_is_one_line(tmp_path, monkeypatch):
    """llama.cpp's quantizer runs in a child process; a stand-in for it that dies by SIGILL gives `export` a one-line
    error naming the signal and the portable build, instead of killing the command."""
    from erniekit_lite import export
    from erniekit_lite.errors import UserError

    monkeypatch.setattr(export, "quantizer", lambda: None)  # no llama-cpp-python needed for the stand-in
    monkeypatch.setattr(export, "QUANTIZE", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    with pytest.raises(UserError) as refused:
        export.quantize(tmp_path / "model-f16.gguf", tmp_path / "model-q4_k_m.gguf", "q4_k_m", lambda *_: None)
    message = str(refused.value)
    assert "\n" not in message and "llama.cpp's quantizer was killed by SIGILL" in message
    assert "-DGGML_NATIVE=OFF" in message
    monkeypatch.setattr(export, "QUANTIZE", f"import os, signal; os.kill(os.getpid(), {int(signal.SIGSEGV)})")
    with pytest.raises(UserError, match="killed by SIGSEGV on .*model-f16.gguf \\(q4_k_m\\)$"):
        export.quantize(tmp_path / "model-f16.gguf", tmp_path / "model-q4_k_m.gguf", "q4_k_m", lambda *_: None)
    monkeypatch.setattr(export, "QUANTIZE", "import sys; print('bad magic', file=sys.stderr); sys.exit(1)")
    with pytest.raises(UserError, match=r"quantizer failed on .* \(q4_k_m\): bad magic$"):
        export.quantize(tmp_path / "model-f16.gguf", tmp_path / "model-q4_k_m.gguf", "q4_k_m", lambda *_: None)


def test_no_llama_cpp_python_is_one_line_and_nothing_native_loads_here(monkeypatch):
    """k-quants without llama-cpp-python: one line saying what to install. Found, it is not imported in this process
    (its native library loads only in the quantizer's child)."""
    import sys

    from erniekit_lite import export
    from erniekit_lite.errors import UserError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(UserError, match=r"^k-quants go through llama.cpp's quantizer: pip install llama-cpp-python"):
        export.quantizer()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "llama_cpp" else real(name, *a))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    export.quantizer()
    assert "llama_cpp" not in sys.modules
