"""How often training's token ids differ from a serving engine's for the same multi-turn conversation.

Training tokenizes each turn's prompt (`... Assistant: `) and answer separately, as ERNIEKit does, so an answer
starts after a lone `▁` (what generation sees). A serving engine (vLLM, `apply_chat_template(tokenize=True)`, the
usual model-card snippet) tokenizes the whole rendered string, which fuses that space into the answer's first word
(`▁Hello`) for every earlier answer in the history. This counts, on the demo data in `../shared/data`, the
conversations whose ids differ, with the ERNIE 4.5 template and the real tokenizer: the full conversation, and the
inference prompt of its last turn (history + last question), which is what a served multi-turn chat feeds the model.
Deterministic: one round. Writes benchmarks/results-serving_tokens.txt.

    python benchmarks/serving_tokens.py
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import _common  # benchmarks/ is the script's own directory, first on sys.path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("ERNIEKIT_SHARED", ROOT.parent / "shared"))
FILES = [SHARED / "data/erniekit/function-call-train.jsonl", SHARED / "data/llamafactory/glaive_toolcall_en_demo.json",
         SHARED / "data/erniekit/sft-train-10lines.jsonl", SHARED / "data/llamafactory/identity.json"]


def ids_of(tok, pieces) -> list[int]:
    encoded = iter(tok.encode_pieces(pieces))
    return [t for p in pieces for t in (next(encoded) if p.text is not None else p.ids)]


def one_string(tokenizer, pieces) -> list[int]:
    """The same rendering as one string, control tokens parsed: what a serving engine tokenizes."""
    text = "".join(p.text if p.text is not None else tokenizer.decode(list(p.ids)) for p in pieces)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results-serving_tokens.txt"), help="results file")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from erniekit_lite.data.formats import detect_format, to_conversation
    from erniekit_lite.data.load import read_records
    from erniekit_lite.data.template import template_for
    from erniekit_lite.data.tokenize import Tokenizer
    from erniekit_lite.model.load import load_tokenizer

    tokenizer = load_tokenizer(str(SHARED / "ernie45" / "ernie-4.5-0.3b-base-pt"))
    tok = Tokenizer(tokenizer, template_for(tokenizer))
    lines = ["# training ids vs one-string (serving) ids, ERNIE 4.5 template, real tokenizer", ""]
    lines.append("| file | conversations | multi-turn | whole conversation differs (one-string training, as TRL) | "
                 "last turn's inference prompt differs: multi-turn | ...: single-turn |")
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for path in FILES:
        records = read_records(str(path))
        fmt = detect_format(records[0])
        convs = [to_conversation(r, fmt) for r in records]
        multi = sum(len(c.turns) > 1 for c in convs)
        whole, prompts = 0, {True: 0, False: 0}
        for conv in convs:
            turns = tok.template.pieces(conv)
            pieces = [p for turn in turns for p in turn]
            whole += ids_of(tok, pieces) != one_string(tokenizer, pieces)
            # the last turn's inference prompt: the history and the last question, up to `Assistant: `
            *history, final = turns
            cut = next(i for i, p in enumerate(final) if p.response)
            prompt = [p for turn in history for p in turn] + final[:cut]
            prompts[len(conv.turns) > 1] += ids_of(tok, prompt) != one_string(tokenizer, prompt)
        lines.append(f"| {path.relative_to(SHARED)} | {len(convs)} | {multi} | {whole} | {prompts[True]} of {multi} | "
                     f"{prompts[False]} of {len(convs) - multi} |")
    rev = _common.git_revision()
    import tokenizers
    import transformers

    lines += ["", f"machine: {platform.machine()} {platform.processor() or ''}".strip(),
              f"git {rev}; transformers {transformers.__version__}, tokenizers {tokenizers.__version__}",
              "command: python benchmarks/serving_tokens.py"]
    out = Path(args.out)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
