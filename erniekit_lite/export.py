"""`erniekit-lite export RUN --to gguf`: a GGUF for llama.cpp (and an Ollama Modelfile), made by llama.cpp's own tools.

- A LoRA run is merged first (`merge`); a full run or a model dir is converted as it is.
- llama.cpp's `convert_hf_to_gguf.py` converts (ERNIE 4.5 dense and MoE: its `conversion/ernie.py`), found in a
  llama.cpp checkout (`--llama-cpp DIR`, or `$LLAMA_CPP_DIR`) or in the unpacked source distribution of
  `llama-cpp-python`, which vendors llama.cpp with the converter and `gguf-py` (`DIR/vendor/llama.cpp`). It writes
  f32, f16, bf16 or q8_0; k-quants (q4_k_m, ...) go through llama.cpp's own quantizer, which `llama-cpp-python`
  exposes (`llama_model_quantize`). Nothing is downloaded.
- The converter types ERNIE's chat markers (`<|begin_of_sentence|>`, `<|end_of_sentence|>`, ...) as plain text when
  the checkpoint's tokenizer files do not mark them special, so llama.cpp would split a rendered template into
  text pieces. erniekit-lite marks every special token of the tokenizer as a control token in the GGUF (in place:
  the token-type array has a fixed width).
- Without `tokenizer.ggml.add_bos_token` and `tokenizer.ggml.add_space_prefix` llama.cpp defaults, for a
  sentencepiece vocabulary, to putting `<s>` before a prompt and a space before the text after each control token;
  ERNIE's tokenizer does neither. The converter reads both from `tokenizer_config.json` (`add_bos_token`,
  `add_eos_token`, `add_prefix_space`), so the staged copy it converts gets what the transformers tokenizer does.
  llama.cpp then tokenizes a single-turn prompt rendered by the Modelfile's template, with its default BOS
  handling and control tokens parsed, into the ids training builds for it (tested with llama-cpp-python; Ollama
  reads the same GGUF keys, but is not run by the tests).
  A multi-turn prompt gives transformers' tokenization of the whole rendered string, which differs from training's
  in one place per earlier answer: training tokenizes each answer apart from its prompt (`Assistant: ` ending in
  the token `▁`), a whole string fuses that space into the answer's first token.
- llama.cpp's converter skips the multi-token-prediction tensors of the released 21B-A3B (`model.mtp_*`); export
  says how many the GGUF leaves out.
- `--ollama` adds a `Modelfile`: FROM the GGUF, the ERNIE template in Ollama's template syntax, the stop tokens and
  the recipe's system prompt.
- Everything is written beside `--out` and renamed when complete: a failed export leaves nothing half-written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from erniekit_lite.errors import UserError
from erniekit_lite.files import staged

CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")
QUANTIZER_TYPES = {  # llama.cpp's llama_ftype values (llama.h), quantized from the f16 GGUF
    "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k_s": 11, "q3_k_m": 12, "q3_k_l": 13,
    "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18,
}
MARKER = "erniekit_export.json"  # written last: a dir holding it is a complete export
CONTROL = 3  # gguf TokenType.CONTROL

# Ollama's Go template for the ERNIE 4.5 format (data/template.py): BOS, the system prompt and a newline, then
# "User: {text}\n" and "Assistant: {text}<|end_of_sentence|>" per message, ending in "Assistant: " to generate
OLLAMA_TEMPLATE = (
    '<|begin_of_sentence|>{{ range .Messages }}{{ if eq .Role "system" }}{{ .Content }}\n'
    '{{ else if eq .Role "user" }}User: {{ .Content }}\n'
    '{{ else if eq .Role "assistant" }}Assistant: {{ .Content }}<|end_of_sentence|>{{ end }}{{ end }}Assistant: '
)
STOP = ("</s>", "<|end_of_sentence|>")


def export(run: str, to: str, out: str, outtype: str = "f16", ollama: bool = False, llama_cpp: str | None = None,
           overwrite: bool = False, log=print) -> Path:
    if to != "gguf":
        raise UserError(f"--to: {to!r}; expected gguf")
    if outtype not in CONVERTER_TYPES and outtype not in QUANTIZER_TYPES:
        raise UserError(f"--outtype: {outtype!r}; expected one of {', '.join([*CONVERTER_TYPES, *QUANTIZER_TYPES])}")
    source = finished(run)
    from erniekit_lite.model.vl import is_vl_run

    if is_vl_run(str(source)):
        raise UserError(f"{run}: an ERNIE-4.5-VL model; llama.cpp's GGUF converter has no ERNIE-4.5-VL architecture "
                        "(vision encoder, modality-isolated experts): serve it with vLLM (`erniekit-lite serve RUN --engine vllm`)")
    converter = find_converter(llama_cpp)
    if outtype in QUANTIZER_TYPES:
        quantizer()  # refused before any work when llama-cpp-python is missing
    target = Path(out)
    if target.exists() and any(target.iterdir()):
        if not overwrite:
            raise UserError(f"{target}: not empty; choose a new directory for the export, or --overwrite (nothing was written)")
        if not (target / MARKER).is_file():
            raise UserError(f"{target}: not empty and not a previous export; --overwrite only replaces an export (nothing was written)")
    with staged(target, "exporting") as staging:
        model_dir = hf_model(source, staging / "hf" / source.resolve().name, log)  # the converter names the model after the dir
        from erniekit_lite.model.load import load_tokenizer

        tokenizer = load_tokenizer(str(model_dir))
        flags = tokenizer_flags(tokenizer, model_dir)
        gguf = staging / f"model-{outtype}.gguf"
        first = outtype if outtype in CONVERTER_TYPES else "f16"
        convert(converter, model_dir, staging / f"model-{first}.gguf", first, log)
        control = mark_control_tokens(converter, staging / f"model-{first}.gguf", tokenizer, flags)
        left_out = skipped_tensors(model_dir)
        if left_out:
            log(f"export: the GGUF leaves out {len(left_out)} multi-token-prediction tensor(s) of the checkpoint (model.mtp_*), "
                "which llama.cpp's converter skips; llama.cpp answers without them, as transformers does")
        if outtype not in CONVERTER_TYPES:
            quantize(staging / f"model-{first}.gguf", gguf, outtype, log)
            (staging / f"model-{first}.gguf").unlink()
        if ollama:
            (staging / "Modelfile").write_text(modelfile(gguf.name, system_prompt(run)), encoding="utf-8")
        shutil.rmtree(staging / "hf", ignore_errors=True)
        (staging / MARKER).write_text(json.dumps({"run": str(run), "outtype": outtype, "gguf": gguf.name, "converter": str(converter),
                                                  "control_tokens_marked": control, "tokenizer_flags": flags,
                                                  "tensors_left_out": len(left_out), "ollama": ollama}) + "\n")
    log(f"export: {target / gguf.name}" + (f" and {target / 'Modelfile'} (ollama create NAME -f {target / 'Modelfile'})" if ollama else ""))
    return target / gguf.name


def finished(run: str) -> Path:
    path = Path(run)
    if not path.is_dir():
        raise UserError(f"{run}: no such directory (expected a finished run's output dir or a model dir)")
    if not any((path / name).is_file() for name in ("config.json", "adapter_config.json")):
        if (path / "recipe.yaml").is_file():
            raise UserError(f"{run}: a run that has not finished (no model saved yet); export a checkpoint-N dir of it, or finish it with --resume")
        raise UserError(f"{run}: not a model dir (no config.json or adapter_config.json)")
    from erniekit_lite.model.reward import refuse_reward_run

    refuse_reward_run(run, "export")
    return path


def find_converter(llama_cpp: str | None) -> Path:
    """llama.cpp's convert_hf_to_gguf.py: in DIR (a llama.cpp checkout) or DIR/vendor/llama.cpp (llama-cpp-python's sdist)."""
    given = llama_cpp or os.environ.get("LLAMA_CPP_DIR")
    if given is None:
        raise UserError("export needs llama.cpp's converter: pass --llama-cpp DIR (a llama.cpp checkout, or the unpacked source "
                        "distribution of llama-cpp-python: pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all:) "
                        "or set LLAMA_CPP_DIR")
    root = Path(given).expanduser().resolve()  # absolute: the converter runs with its own folder as cwd
    for candidate in (root / "convert_hf_to_gguf.py", root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"):
        if candidate.is_file():
            return candidate
    raise UserError(f"--llama-cpp: {given}: no convert_hf_to_gguf.py there or in vendor/llama.cpp (expected a llama.cpp "
                    "checkout or an unpacked llama-cpp-python source distribution)")


def hf_model(source: Path, merged_dir: Path, log) -> Path:
    """A plain transformers checkpoint in `merged_dir` (merged, or the source's files linked) with the sentencepiece
    `tokenizer.model` the converter reads. Everything that can refuse is checked before a LoRA run is merged (a 21B
    merge takes long)."""
    from erniekit_lite.model.source import adapter_base

    base = adapter_base(str(source))
    config_dir = source if base is None else Path(base) if (Path(base) / "config.json").is_file() else None
    if config_dir is not None:
        llama_cpp_reads(config_dir)
    spm = sentencepiece_model(source, base)
    if base is None:
        model_dir = source
    else:
        from erniekit_lite.model.merge import merge

        log(f"export: merging the LoRA run {source} into its base first")
        model_dir = merge(str(source), str(merged_dir), log=log)
        llama_cpp_reads(model_dir)
    if model_dir == source:  # never write into the user's run: convert a linked copy, its tokenizer_config.json a file
        model_dir = merged_dir
        model_dir.mkdir(parents=True, exist_ok=True)
        for item in source.iterdir():
            if item.is_file() and item.name != "tokenizer_config.json":
                (model_dir / item.name).symlink_to(item.resolve())
        if (source / "tokenizer_config.json").is_file():
            shutil.copy(source / "tokenizer_config.json", model_dir / "tokenizer_config.json")
    if not (model_dir / "tokenizer.model").is_file():
        shutil.copy(spm, model_dir / "tokenizer.model")
    return model_dir


def sentencepiece_model(source: Path, base: str | None) -> Path:
    """`tokenizer.model`: in the run, its LoRA base, or the model its recipe trained (a full run saves only
    tokenizer.json); a Hub id's copy comes from the Hugging Face cache (downloaded once if not there)."""
    import yaml

    candidates = [str(source), base]
    recipe = source / "recipe.yaml"
    if recipe.is_file():
        try:
            candidates.append(((yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}).get("model") or {}).get("path"))
        except yaml.YAMLError:
            pass  # the recipe is only a hint here
    for candidate in filter(None, candidates):
        if (Path(candidate) / "tokenizer.model").is_file():
            return Path(candidate) / "tokenizer.model"
    for candidate in filter(None, candidates[1:]):
        if not Path(candidate).exists() and candidate.count("/") == 1:  # a Hub id
            from erniekit_lite.model.source import sentencepiece_file

            try:
                found = sentencepiece_file(candidate)
            except Exception:  # offline: say below what is missing
                continue
            if found is not None:
                return found
    raise UserError(f"{source}: no sentencepiece tokenizer.model (nor in its base model), which llama.cpp's converter reads; "
                    "the built-in tiny tokenizer has none (make the tiny model with --tokenizer baidu/ERNIE-4.5-0.3B-PT, or a folder "
                    "holding a released tokenizer)")


def llama_cpp_reads(model_dir: Path) -> None:
    """Refuse an MoE shape that llama.cpp would not load: its converter writes the shared experts' width as
    intermediate_size // num_key_value_heads (true of the released 21B-A3B: 12288 // 4 = 1536 x 2 shared)."""
    config = json.loads((model_dir / "config.json").read_text())
    shared = config.get("moe_num_shared_experts") or 0
    if config.get("model_type") != "ernie4_5_moe" or not shared:
        return
    width = config["moe_intermediate_size"] * shared
    derived = config["intermediate_size"] // config["num_key_value_heads"]
    if width != derived:
        raise UserError(f"{model_dir / 'config.json'}: shared experts {width} wide (moe_intermediate_size x moe_num_shared_experts), "
                        f"but llama.cpp's converter writes intermediate_size // num_key_value_heads = {derived}, and llama.cpp "
                        "would refuse the GGUF; the released ERNIE 4.5 MoE shapes satisfy this (nothing was written)")


def convert(converter: Path, model_dir: Path, gguf: Path, outtype: str, log) -> None:
    log(f"export: converting {model_dir} to {outtype} with {converter}")
    done = subprocess.run([sys.executable, str(converter), str(model_dir.resolve()), "--outfile", str(gguf.resolve()), "--outtype", outtype],
                          capture_output=True, text=True, cwd=converter.parent)
    if done.returncode != 0 or not gguf.is_file():
        last = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}").splitlines()[-1]
        raise UserError(f"llama.cpp's converter failed on {model_dir}: {last}")


def tokenizer_flags(tokenizer, model_dir: Path) -> dict[str, bool]:
    """What the transformers tokenizer does around text, written into the converted copy's tokenizer_config.json
    under the keys llama.cpp's converter reads (gguf-py's SpecialVocab: add_bos_token, add_eos_token; its ERNIE
    vocabulary: add_prefix_space). Without them llama.cpp's sentencepiece defaults add `<s>` and a leading space."""
    plain = tokenizer("Hello", add_special_tokens=False)["input_ids"]
    full = tokenizer("Hello")["input_ids"]
    flags = {
        "add_bos_token": tokenizer.bos_token_id is not None and full[:1] == [tokenizer.bos_token_id] != plain[:1],
        "add_eos_token": tokenizer.eos_token_id is not None and full[-1:] == [tokenizer.eos_token_id] != plain[-1:],
        "add_prefix_space": tokenizer.convert_ids_to_tokens(plain[:1])[0].startswith("\u2581"),
    }
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if path.is_symlink():  # a link into the user's files: replaced, never written through
        path.unlink()
    path.write_text(json.dumps(config | flags, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return flags


def mark_control_tokens(converter: Path, gguf: Path, tokenizer, flags: dict[str, bool]) -> list[str]:
    """Type the tokenizer's special tokens as CONTROL in the GGUF, in place; the ones changed. Checks that the
    converter wrote the tokenizer flags (an older llama.cpp may not read them)."""
    sys.path.insert(0, str(converter.parent / "gguf-py"))  # the converter's own gguf-py, as it imports it
    try:
        from gguf import GGUFReader
    finally:
        sys.path.pop(0)
    special = {tokenizer.convert_tokens_to_ids(t): t for t in tokenizer.all_special_tokens}
    special |= {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    reader = GGUFReader(gguf, "r+")
    for key, flag in (("tokenizer.ggml.add_bos_token", "add_bos_token"), ("tokenizer.ggml.add_space_prefix", "add_prefix_space")):
        field = reader.fields.get(key)
        if field is None or bool(field.parts[field.data[0]][0]) != flags[flag]:
            raise UserError(f"llama.cpp's converter {converter} did not write {key} = {str(flags[flag]).lower()} (from "
                            f"tokenizer_config.json's {flag}); llama.cpp would tokenize prompts unlike training. Use a newer "
                            "llama.cpp (llama-cpp-python 0.3.36's does)")
    types = reader.fields["tokenizer.ggml.token_type"]
    changed = []
    for token_id, text in sorted(special.items()):
        if token_id is None or token_id >= len(types.data):
            continue
        value = types.parts[types.data[token_id]]
        if int(value[0]) != CONTROL:
            value[0] = CONTROL
            changed.append(text)
    reader.data.flush()
    return changed


MTP = re.compile(r"model\.mtp_(?:block|emb_norm|hidden_norm|linear_proj)\.\d+")  # what conversion/ernie.py skips


def skipped_tensors(model_dir: Path) -> list[str]:
    """The checkpoint's tensors that llama.cpp's converter skips (the MTP block), read from the safetensors headers."""
    from safetensors import safe_open

    names = []
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            names += [name for name in f.keys() if MTP.match(name)]
    return sorted(names)


def quantizer() -> None:
    """Refuses when llama-cpp-python is missing; found, not imported: its native library loads only in the child."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        raise UserError("k-quants go through llama.cpp's quantizer: pip install llama-cpp-python (or use --outtype f16/bf16/q8_0)")


# The quantizer runs in a child process: llama.cpp is native code built for some instruction set, and on a CPU it was
# not built for it dies by a signal (SIGILL), which in-process would end `export` (and a test run) with no message
QUANTIZE = """
import sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params) != 0)
"""


def quantize(source: Path, target: Path, outtype: str, log) -> None:
    quantizer()
    log(f"export: quantizing to {outtype} with llama.cpp's quantizer")
    done = subprocess.run([sys.executable, "-c", QUANTIZE, str(source), str(target), str(QUANTIZER_TYPES[outtype])],
                          capture_output=True, text=True, errors="replace")
    if done.returncode < 0:
        raise UserError(f"llama.cpp's quantizer was killed by {signal_name(-done.returncode)} on {source} ({outtype})"
                        f"{NATIVE_HINT if -done.returncode == signal.SIGILL else ''}")
    if done.returncode != 0 or not target.is_file():
        last = (done.stderr.strip().splitlines() or [""])[-1]
        raise UserError(f"llama.cpp's quantizer failed on {source} ({outtype}){': ' + last if last else ''}")


NATIVE_HINT = (": llama-cpp-python was built for instructions this CPU lacks (llama.cpp builds for the CPU it is built on);"
               " rebuild it portable with CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON\""
               " (docs/after-training.md: GGUF for llama.cpp and Ollama)")


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def system_prompt(run: str) -> str | None:
    import yaml

    recipe = Path(run) / "recipe.yaml"
    if not recipe.is_file():
        return None
    return ((yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}).get("data") or {}).get("system")


def modelfile(gguf_name: str, system: str | None) -> str:
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{OLLAMA_TEMPLATE}"""', *(f'PARAMETER stop "{s}"' for s in STOP)]
    if system:
        lines.append(f'SYSTEM """{system}"""')
    return "\n".join(lines) + "\n"
