"""What the tests ask of llama.cpp (`llama-cpp-python`), as functions `helpers.in_child` runs in a child process:
plain arguments in, JSON-able results out. A crash in the engine then fails one test, not the run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _agreement():
    spec = importlib.util.spec_from_file_location("gguf_agreement", ROOT / "benchmarks" / "gguf_agreement.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def greedy(gguf: str, prompts: list[list[int]], stop: list[int], tokens: int) -> list[list[int]]:
    """benchmarks/gguf_agreement.llama_greedy: greedy continuation ids up to a stop token."""
    return _agreement().llama_greedy(Path(gguf), prompts, set(stop), tokens)


def tokenize(gguf: str, texts: list[str], special: bool, add_bos: bool | None = None) -> list[list[int]]:
    """llama.cpp's tokenization of each text with the GGUF's vocabulary (`add_bos` None: llama.cpp's default)."""
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=gguf, n_ctx=64, verbose=False, vocab_only=True)
    extra = {} if add_bos is None else {"add_bos": add_bos}
    return [vocab.tokenize(t.encode("utf-8"), special=special, **extra) for t in texts]


def metadata(gguf: str) -> dict:
    import llama_cpp

    return dict(llama_cpp.Llama(model_path=gguf, n_ctx=64, verbose=False, vocab_only=True).metadata)


def tensor_types(gguf: str, llama_cpp_dir: str) -> dict[str, str]:
    """Each tensor's storage type in the GGUF (`Q8_0`, `Q4_K`, `F32`, ...), read by llama.cpp's own gguf-py."""
    import sys

    for root in (Path(llama_cpp_dir), Path(llama_cpp_dir) / "vendor" / "llama.cpp"):
        if (root / "gguf-py").is_dir():
            sys.path.insert(0, str(root / "gguf-py"))
            break
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(gguf).tensors}
