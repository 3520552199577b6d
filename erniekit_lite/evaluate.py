"""`erniekit-lite eval`: loss and perplexity of a model on a data file, and with `--generate` its answers.

The data goes through training's own pipeline (`data.prepare`: format, template, tokenize, packing) and is
scored as training scores it (`scoring.score`: the LM head only at trained positions), so the loss is the
token-weighted mean negative log-likelihood of the trained (assistant) tokens: the `eval_loss` a training run
reports on the same data (exactly when its eval set fits one eval batch: the Trainer averages per-batch losses,
each token-weighted only within its batch). Answers are generated for each record's conversation up to its last user turn,
through the same template, in the data's order, so files written for a base and a tuned model line up.

Where the files go (`result_files`, `--tasks` too): `--out FILE`, never over an existing file without `overwrite`; with
`--generate`, FILE is the answers JSONL and the metrics go beside it (`answers.jsonl` -> `answers.metrics.json`).
Without `--out`, `eval/eval_results[-N].json` (and `eval/eval_generations[-N].jsonl`) in the folder of the model
evaluated (`results_home`): a run's output dir, a model dir, a recipe's model.path, `--tasks --adapter`'s run; never the
working folder. A subfolder: `push` uploads a run's top-level files only, so the eval data's prompts stay local.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from erniekit_lite.errors import UserError
from erniekit_lite.recipe import DataSection, ModelSection, Source

DEFAULT_MAX_LENGTH = 2048


def evaluate(
    target: str,
    data_file: str,
    out: str | None = None,
    generate: bool = False,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    max_samples: int | None = None,
    log=print,
    overwrite: bool = False,
) -> dict:
    """Score `data_file` with the model of `target` (a recipe, a model or run dir, a Hub id); write and return the results.

    Written to `out` (with `generate`: the answers there, the metrics beside it), else into the model's folder
    (`result_files`); an existing `out` only with `overwrite`."""
    for flag, value in (("--max-new-tokens", max_new_tokens), ("--batch-size", batch_size), ("--max-samples", max_samples or 1)):
        if value < 1:
            raise UserError(f"{flag} must be at least 1 (got {value})")
    model_section, data = resolve(target, data_file, max_samples)
    recipe = Path(target).suffix.lower() in (".yaml", ".yml")
    results_path, generations_path = result_files(out, generate, overwrite, model_section.path, target if recipe else None)

    from erniekit_lite.data.prepare import prepare
    from erniekit_lite.model.load import load_tokenizer
    from erniekit_lite.model.source import tokenizer_path

    tokenizer = load_tokenizer(tokenizer_path(model_section.path), model_section.trust_remote_code)
    prepared = prepare(data, tokenizer, log=log).train  # the eval file stands where prepare expects training data
    model = load(model_section)
    nll, tokens = score_rows(model, prepared.rows, batch_size, data.max_length)
    source, stats = prepared.sources[0], prepared.stats
    results = {
        "model": model_section.path,
        "data": data_file,
        "format": source.format,
        "max_length": data.max_length,
        "system": data.system,
        "records": source.records,
        "samples": source.samples,
        "truncated": stats.truncated,
        "dropped_overlong": stats.dropped_overlong,
        "dropped_untrained": stats.dropped_untrained,
        "eval_loss": nll / tokens,
        "eval_perplexity": math.exp(nll / tokens),
        "eval_tokens": tokens,
        "generations": str(generations_path) if generate else None,
    }
    results_path.parent.mkdir(parents=True, exist_ok=True)  # eval/ in the model's folder, made only now
    results_path.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    log(
        f"eval: loss {results['eval_loss']:.4f}, perplexity {results['eval_perplexity']:.4g} over {tokens:,} trained tokens "
        f"({source.samples} samples of {source.records} records in {data_file}); wrote {results_path}"
    )
    if generate:
        from erniekit_lite.model.attention import PACKED

        if model.config._attn_implementation in PACKED:
            model.set_attn_implementation("sdpa")  # the same kernel, with the padding mask batched generation needs
        lines = answer_records(model, tokenizer, data, source.format, batch_size, max_new_tokens)
        generations_path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
        log(f"eval: {len(lines)} answers written to {generations_path}")
    return results


def resolve(target: str, data_file: str, max_samples: int | None) -> tuple[ModelSection, DataSection]:
    """The model to load and the data settings: a recipe's own (its model.path), or defaults for a model path."""
    if Path(target).suffix.lower() in (".yaml", ".yml"):
        from erniekit_lite import recipe as recipes

        recipe = recipes.load(target)
        # eval --data reads conversations: only an SFT recipe's format says how (pairs, feedback and raw text do not)
        fmt = recipe_format(recipe.data, data_file) if recipe.method == "sft" else "auto"
        source = Source(path=data_file, format=fmt, max_samples=max_samples)
        data = DataSection(train=[source], max_length=recipe.data.max_length, overlong=recipe.data.overlong, system=recipe.data.system)
        return recipe.model, data
    check_model_path(target)
    import torch

    # A model dir says nothing of precision: bf16 on a GPU (as `chat`), fp32 on CPU (as training there)
    model = ModelSection(path=target, dtype="bfloat16" if torch.cuda.is_available() else "float32")
    return model, DataSection(train=[Source(path=data_file, max_samples=max_samples)], max_length=DEFAULT_MAX_LENGTH)


def recipe_format(data: DataSection, data_file: str) -> str:
    """The format the recipe names for this file, or the one all its sources name; else auto-detect."""
    sources = data.eval + data.train
    named = {s.format for s in sources if Path(s.path).resolve() == Path(data_file).resolve()} or {s.format for s in sources}
    return named.pop() if len(named) == 1 else "auto"


def check_model_path(path: str) -> None:
    """A local path must be a model or run dir; only an ORG/NAME that is not a local path is left to the Hub."""
    local = Path(path).expanduser()
    expected = "expected a recipe .yaml, a model or run output dir, or a Hub id"
    # `runs/typo` would otherwise spend a minute retrying the Hub before failing
    if not local.exists() and (not re.fullmatch(r"[\w.-]+/[\w.-]+", path) or local.parent.is_dir()):
        raise UserError(f"{path}: no such directory; {expected}")
    if local.is_file():
        raise UserError(f"{path}: is a file; {expected}")
    if local.is_dir() and not any((local / name).is_file() for name in ("config.json", "adapter_config.json")):
        raise UserError(f"{path}: not a model dir (no config.json or adapter_config.json); {expected}")
    from erniekit_lite.model.reward import refuse_reward_run

    refuse_reward_run(path, "eval")


def result_files(out: str | None, generate: bool, overwrite: bool, model: str, recipe: str | None = None) -> tuple[Path, Path | None]:
    """The metrics (or lm-eval results) file and, with `generate`, the answers file, checked before anything runs:
    `out` (see `output_paths`), refused when it or the file beside it exists unless `overwrite`; without `out`, the
    first free numbers in `results_home(model)`/eval. `recipe`: the recipe whose model.path `model` is."""
    if out is None:
        if overwrite:
            raise UserError("eval: --overwrite goes with --out (without it the results take new numbered files)")
        return output_paths(None, generate, results_home(model, recipe))
    paths = output_paths(out, generate)
    taken = [str(p) for p in (paths[::-1] if generate else paths[:1]) if p.exists()]  # the file named first
    if taken and not overwrite:
        raise UserError(f"--out: {taken[0]} exists; choose another --out, or --overwrite to replace it (nothing was written)")
    return paths


def results_home(model: str, recipe: str | None = None) -> Path:
    """Where results go without `--out`: eval/ in the folder of the model evaluated (a run's output dir or a model dir).
    A Hub id has no folder of the user's, and the working folder is never guessed: `--out` then."""
    if recipe is None:
        check_model_path(model)  # a typo is "no such directory", not "give --out"
    folder = Path(model).expanduser()
    if not folder.is_dir():
        what = f"{recipe}: its model.path {model}" if recipe else model
        raise UserError(f"eval: {what} is not a local folder to keep the results in; say where they go with --out FILE")
    home = folder / "eval"
    if home.exists() and not home.is_dir():
        raise UserError(f"eval: {home} is not a folder, so the results cannot go there; say where they go with --out FILE")
    if not os.access(home if home.is_dir() else folder, os.W_OK):
        raise UserError(f"eval: {home if home.is_dir() else folder} is not writable; say where the results go with --out FILE")
    return home


def output_paths(out: str | None, generate: bool, home: Path | None = None) -> tuple[Path, Path | None]:
    """(metrics or results file, answers file or None). `--out` names the metrics file, or with `generate` the answers
    file, the metrics beside it: FILE.jsonl -> FILE.metrics.json. Without it, the first free eval_results[-N].json /
    eval_generations[-N].jsonl pair in `home` (None: the working folder, for `tasks.run_tasks(out=None)` callers).
    Existing files are `result_files`' to refuse: `run_tasks` is handed a path already checked."""
    if out is not None:
        named = Path(out)
        if named.is_dir():
            example = named / ("answers.jsonl" if generate else "eval_results.json")
            raise UserError(f"--out: {out} is a directory; give a file name, e.g. {example}")
        if generate and named.suffix.lower() == ".json":
            raise UserError(f"--out {out}: with --generate, --out names the answers file (JSONL), and the metrics go beside "
                            f"it; give e.g. {named.with_suffix('.jsonl')} (metrics: {named.with_suffix('.metrics.json')})")
        named.parent.mkdir(parents=True, exist_ok=True)
        return (named.with_suffix(".metrics.json"), named) if generate else (named, None)
    home = Path(".") if home is None else home
    n = 1
    # Never overwrite an earlier evaluation: results and generations take the first number free for both
    while (home / _numbered("eval_results", n, ".json")).exists() or (home / _numbered("eval_generations", n, ".jsonl")).exists():
        n += 1
    results = home / _numbered("eval_results", n, ".json")
    return results, home / _numbered("eval_generations", n, ".jsonl") if generate else None


def _numbered(stem: str, n: int, suffix: str) -> str:
    return f"{stem}{'' if n == 1 else f'-{n}'}{suffix}"


def load(section: ModelSection):
    """The model in eval mode (base + adapter for a LoRA dir), on the GPU when there is one."""
    import torch

    from erniekit_lite.model.attention import resolve_attention
    from erniekit_lite.model.load import load_model

    attn = resolve_attention(section.attn_implementation, packing=True)
    model = load_model(section.path, section.dtype, attn, section.trust_remote_code, trainable_adapter=False, load_in_4bit=section.load_in_4bit)
    if torch.cuda.is_available() and next(model.parameters()).device.type == "cpu":
        model = model.to("cuda")
    return model.eval()


def score_rows(model, rows, batch_size: int, max_length: int) -> tuple[float, int]:
    """Summed negative log-likelihood of the trained tokens of the packed `rows`, and how many there are."""
    import torch
    from tqdm import tqdm

    from erniekit_lite.data.collate import PackedCollator
    from erniekit_lite.model.attention import take_batch_lengths
    from erniekit_lite.model.lora import unwrap
    from erniekit_lite.train.scoring import score

    collate = PackedCollator(max_length)
    # As the trainer does: score the causal LM inside the peft wrapper (its LoRA layers are in there)
    inner = unwrap(model)
    device = next(model.parameters()).device
    nll, tokens = 0.0, 0
    with torch.no_grad(), tqdm(total=len(rows), desc="scoring", unit="row", disable=None) as bar:
        for start in range(0, len(rows), batch_size):
            batch = collate([vars(row) for row in rows[start : start + batch_size]])
            labels = batch.pop("labels").to(device)
            for key in ("token_slots", "real_tokens"):
                del batch[key]
            inputs = take_batch_lengths({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
            log_probs = score(inner, labels, inputs, extras=False).log_probs
            nll -= log_probs.double().sum().item()  # summed in float64: one division at the end, over all batches
            tokens += log_probs.numel()
            bar.update(len(rows[start : start + batch_size]))
    return nll, tokens


def answer_records(model, tokenizer, data: DataSection, fmt: str, batch_size: int, max_new_tokens: int) -> list[dict]:
    """Each record's last user turn answered after its earlier turns, next to the answer the data gives."""
    from tqdm import tqdm

    from erniekit_lite.data.formats import to_conversation, with_calls
    from erniekit_lite.data.load import read_records
    from erniekit_lite.generate import Prompt, answers

    source = data.train[0]
    records = read_records(source.path, source.split, source.max_samples)
    convs = [to_conversation(record, fmt, data.system) for record in records]
    prompts = [Prompt(c.turns[-1].user, c.system, c.turns[:-1]) for c in convs]
    with tqdm(total=len(prompts), desc="generating", unit="prompt", disable=None) as bar:
        texts = answers(model, tokenizer, prompts, batch_size, max_new_tokens, progress=bar)
    return [
        {"line": record.line, "prompt": c.turns[-1].user, "reference": with_calls(c.turns[-1].assistant, c.turns[-1].tool_calls), "answer": text}
        for record, c, text in zip(records, convs, texts)
    ]
