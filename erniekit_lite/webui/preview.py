"""The first records as the model sees them: the ERNIE chat format (raw text pieces for `pt`), with the trained
(loss) tokens highlighted.

Records go through the training pipeline itself (`data.prepare`: format detection, template, truncation), so the
preview shows exactly what training will see; only the token runs are decoded back to text here.
"""

from __future__ import annotations

import html

from erniekit_lite.data.tokenize import IGNORE, Sample
from erniekit_lite.recipe import Recipe
from erniekit_lite.trainer_args import PAIR_METHODS

STYLE = (
    "<style>.ek-sample{white-space:pre-wrap;font-family:monospace;border:1px solid #ccc;padding:6px;margin:6px 0}"
    ".ek-sample mark{background:#ffe08a}</style>"
)


def render(recipe: Recipe, records: int = 3, log=print) -> str:
    """HTML of the first `records` records of the first training sources; trained spans are <mark>ed."""
    from erniekit_lite.data.prepare import prepare, prepare_pairs
    from erniekit_lite.model.load import load_tokenizer
    from erniekit_lite.model.source import tokenizer_path

    tokenizer = load_tokenizer(tokenizer_path(recipe.model.path), recipe.model.trust_remote_code)
    sources = [s.model_copy(update={"max_samples": min(records, s.max_samples or records)}) for s in recipe.data.train]
    data = recipe.data.model_copy(update={"train": sources, "eval": [], "eval_split": 0.0})
    if recipe.method == "pt":
        from erniekit_lite.data.documents import prepare_documents

        pieces = prepare_documents(data, tokenizer, log=log).train.pieces
        shown = []
        for i in range(min(records, len(pieces))):
            ids = pieces.ids(i)
            shown.append((f"piece {i + 1}", Sample(ids, [IGNORE] + ids[1:])))
    elif recipe.method == "kto":
        from erniekit_lite.data.prepare import prepare_feedback

        examples = prepare_feedback(data, tokenizer, log=log, kl=False).train.examples[:records]
        shown = [(f"example {i + 1}, {'desirable' if e.desirable else 'undesirable'}", e.sample) for i, e in enumerate(examples)]
    elif recipe.method == "grpo":
        from erniekit_lite.data.prompts import prepare_prompts, prompt_ids
        from erniekit_lite.data.template import template_for
        from erniekit_lite.data.tokenize import Tokenizer

        tok = Tokenizer(tokenizer, template_for(tokenizer))
        items = prepare_prompts(data, tokenizer, log=log).train.items[:records]
        shown = [(f"prompt {i + 1}, reference answer: {item.answer if item.answer is not None else '(none)'}",
                  Sample(ids := prompt_ids(tok, item.messages), [IGNORE] * len(ids))) for i, item in enumerate(items)]
        legend = ("<p>GRPO: each prompt as generation sees it; the completions are sampled during training and they "
                  "alone are trained. The reference answer goes to the reward functions.</p>")
        return STYLE + legend + "".join(_sample_html(title, sample, tokenizer) for title, sample in shown)
    elif recipe.method in PAIR_METHODS:
        pairs = prepare_pairs(data, tokenizer, log=log).train.pairs[:records]
        shown = [(f"pair {i + 1}, {side}", getattr(p, side)) for i, p in enumerate(pairs) for side in ("chosen", "rejected")]
    else:
        shown = [(f"sample {i + 1}", s) for i, s in enumerate(prepare(data, tokenizer, log=log).train.samples[:records])]
    legend = "<p>Highlighted: trained tokens (the loss is computed on them); the rest is context.</p>"
    return STYLE + legend + "".join(_sample_html(title, sample, tokenizer) for title, sample in shown)


def _sample_html(title: str, sample: Sample, tokenizer) -> str:
    parts = []
    for trained, ids in _runs(sample):
        text = html.escape(tokenizer.decode(ids, skip_special_tokens=False))
        parts.append(f"<mark>{text}</mark>" if trained else text)
    trained = sum(label != IGNORE for label in sample.labels)
    return (f"<div><b>{html.escape(title)}</b>: {len(sample)} tokens, {trained} trained"
            f"{' (truncated)' if sample.truncated else ''}<div class='ek-sample'>{''.join(parts)}</div></div>")


def _runs(sample: Sample) -> list[tuple[bool, list[int]]]:
    """Consecutive tokens with the same trained/untrained status, as (trained, ids)."""
    runs: list[tuple[bool, list[int]]] = []
    for token, label in zip(sample.input_ids, sample.labels):
        trained = label != IGNORE
        if runs and runs[-1][0] == trained:
            runs[-1][1].append(token)
        else:
            runs.append((trained, [token]))
    return runs
