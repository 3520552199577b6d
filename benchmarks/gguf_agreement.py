"""How often llama.cpp's greedy tokens equal transformers' after `erniekit-lite export --to gguf`, per outtype.

Tiny random ERNIE 4.5 models (dense and MoE, real tokenizer, 3 seeds each) are exported with llama.cpp's own
converter (and quantizer for k-quants) and run greedily in llama.cpp (`llama-cpp-python`) from the same prompt
ids training builds for each chat prompt; the answers are compared with transformers' greedy answers at fp32.
Deterministic, so a "round" here is a seed: min / median / max over the 3 seeds. Needs `llama-cpp-python` and
LLAMA_CPP_DIR (llama.cpp's converter, e.g. the unpacked llama-cpp-python sdist). Tests import the two greedy
helpers from here (tests/test_export_gguf.py).

    LLAMA_CPP_DIR=... python benchmarks/gguf_agreement.py [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("ERNIEKIT_SHARED", ROOT.parent / "shared"))
PROMPTS = ["Who are you?", "What is 2 + 2?", "Write a haiku about rain.", "你好，请介绍一下你自己。", "List three colours.",
           "Translate 'good morning' into French.", "What is the capital of Japan?", "Give me a word that rhymes with cat.",
           "写一句关于春天的诗。", "Explain gravity in one sentence."]
OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_k_m")
STOP_TOKENS = ("</s>", "<|end_of_sentence|>")


def transformers_greedy(model_dir: Path, prompts: list[str], tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids as training builds them, greedy continuation ids up to a stop token) with transformers."""
    from erniekit_lite.chat import load
    from erniekit_lite.generate import greedy_ids

    model, tokenizer = load(str(model_dir))
    pairs = [greedy_ids(model, tokenizer, text, tokens) for text in prompts]
    return [p for p, _ in pairs], [a for _, a in pairs]


def llama_greedy(gguf: Path, prompts: list[list[int]], stop: set[int], tokens: int) -> list[list[int]]:
    """Greedy continuation ids from llama.cpp for the same prompt ids, up to a stop token."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=256, n_threads=2, verbose=False)
    answers = []
    for ids in prompts:
        llm.reset()
        out = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            if token in stop or len(out) == tokens:
                break
            out.append(token)
        answers.append(out)
    return answers


def agreement(expected: list[list[int]], got: list[list[int]]) -> tuple[int, int, int]:
    """(answers identical, tokens equal before each answer's first difference, tokens in transformers' answers)."""
    same = sum(e == g for e, g in zip(expected, got))
    prefix = 0
    for e, g in zip(expected, got):
        for a, b in zip(e, g):
            if a != b:
                break
            prefix += 1
    return same, prefix, sum(map(len, expected))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results-gguf_agreement.txt"))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens per answer at most")
    p.add_argument("--outtypes", default=",".join(OUTTYPES))
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    import llama_cpp
    from erniekit_lite.export import export, find_converter
    from erniekit_lite.tiny import write_tiny

    converter = find_converter(None)
    tokenizer_dir = SHARED / "ernie45" / "ernie-4.5-0.3b-base-pt"
    outtypes = args.outtypes.split(",")
    lines = [f"# llama.cpp greedy tokens vs transformers' (fp32) after export --to gguf; {len(PROMPTS)} chat prompts, "
             f"up to {args.tokens} tokens each; min / median / max over {args.seeds} seeds",
             f"# llama-cpp-python {llama_cpp.__version__}, converter {converter}", "",
             "| model | outtype | answers identical | tokens equal before the first difference | GGUF MiB |",
             "| --- | --- | --- | --- | --- |"]
    stop = {AutoTokenizer.from_pretrained(tokenizer_dir).convert_tokens_to_ids(t) for t in STOP_TOKENS}
    with tempfile.TemporaryDirectory(prefix="gguf-agreement-") as tmp:
        for arch in ("dense", "moe"):
            rows: dict[str, list[tuple[int, int, int, float]]] = {t: [] for t in outtypes}
            for seed in range(args.seeds):
                model = write_tiny(f"{tmp}/{arch}-{seed}", arch, str(tokenizer_dir), hidden_size=64, layers=3 if arch == "moe" else 2, seed=seed)
                prompt_ids, expected = transformers_greedy(model, PROMPTS, args.tokens)
                for outtype in outtypes:
                    gguf = export(str(model), "gguf", f"{tmp}/{arch}-{seed}-{outtype}", outtype, log=lambda *_: None)
                    got = llama_greedy(gguf, prompt_ids, stop, args.tokens)
                    rows[outtype].append((*agreement(expected, got), gguf.stat().st_size / 2**20))
                    print(f"{arch} seed {seed} {outtype}: {rows[outtype][-1]}", file=sys.stderr, flush=True)
            for outtype, results in rows.items():
                same = [r[0] for r in results]
                prefix = [r[1] / r[2] for r in results]
                lines.append(f"| tiny {arch} (hidden 64) | {outtype} | {min(same)} / {statistics.median(same):g} / {max(same)} of {len(PROMPTS)} "
                             f"| {min(prefix):.1%} / {statistics.median(prefix):.1%} / {max(prefix):.1%} | {results[0][3]:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
