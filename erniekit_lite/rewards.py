"""GRPO reward functions: the built-ins, and the recipe's `rewards:` entries made into TRL reward functions.

A TRL reward function is called once per generation batch as `f(prompts=, completions=, completion_ids=, **columns)`
and returns one float (or None: "does not apply", which TRL averages out) per completion. Here `prompts` are message
lists, `completions` one-message lists `[{"role": "assistant", "content": text}]`, and the data's reference answers
arrive as `answer=[...]` (None where a record has none); TRL also passes `trainer_state`, `log_extra`, `log_metric`.

Built-ins (`name:`):
- `exact_answer`: 1.0 when the completion's final answer equals the reference's, else 0.0 (None, left out of TRL's
  means, without a reference or when the reference has no final answer to read).
  A final answer is the last `\\boxed{...}`, else what follows the last `####` (GSM8K), else the last number in the
  text after any `</think>`; numbers compare as numbers (`1,000` = `1000.0`), anything else as stripped text.
- `think_format`: 1.0 when the completion is exactly one `<think>...</think>` (non-empty reasoning) followed by a
  non-empty answer, else 0.0: the shape a Thinking model's answers take. It reads the text TRL decodes with
  `skip_special_tokens=True`: a tokenizer that marked `<think>` as a special token would hide it (the ERNIE 4.5
  tokenizer in ../shared has no such token; the released Thinking tokenizer is not checked here).
- `length`: 0 up to `args.target` completion tokens (default 256), then -(tokens - target) / target.

Every function's return is checked: a wrong count or a value that is not a number is one line naming the entry.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import Callable

from erniekit_lite.errors import UserError

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def text_of(completion) -> str:
    """A completion's text: TRL passes a string (plain prompts) or a one-message list (chat prompts)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    return str(completion)


def final_answer(text: str) -> str | None:
    """The answer a text ends on: the last \\boxed{...}, else after the last ####, else the last number."""
    text = text.rsplit("</think>", 1)[-1]
    boxed = _last_boxed(text)
    if boxed is not None:
        return _normal(boxed)
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        return _normal(after.splitlines()[0]) if after else None
    numbers = _NUMBER.findall(text)
    return _normal(numbers[-1]) if numbers else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):  # braces nest: \boxed{\frac{1}{2}}
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _normal(answer: str) -> str:
    """Numbers as numbers (commas, a leading $ and a trailing period or .0 dropped); other answers stripped."""
    answer = answer.strip().removeprefix("$").rstrip(".").strip()
    plain = answer.replace(",", "")
    try:
        value = float(plain)
    except ValueError:
        return answer
    return str(int(value)) if value.is_integer() else repr(value)


def exact_answer(completions, answer=None, **kwargs) -> list[float | None]:
    references = answer if answer is not None else [None] * len(completions)
    out: list[float | None] = []
    for completion, reference in zip(completions, references):
        if reference is None or not str(reference).strip():
            out.append(None)
            continue
        want = final_answer(str(reference))
        if want is None:  # a reference with no number, #### or \boxed{} has nothing this reward can compare
            out.append(None)
            continue
        got = final_answer(text_of(completion))
        out.append(1.0 if got == want else 0.0)
    return out


_THINK = re.compile(r"\s*<think>(?P<reasoning>.*?)</think>(?P<answer>.*)", re.DOTALL)


def think_format(completions, **kwargs) -> list[float]:
    out = []
    for completion in completions:
        text = text_of(completion)
        match = _THINK.fullmatch(text)
        ok = (match is not None and text.count("<think>") == 1 and text.count("</think>") == 1
              and match["reasoning"].strip() != "" and match["answer"].strip() != "")
        out.append(1.0 if ok else 0.0)
    return out


def length(completions, completion_ids=None, target: int = 256, **kwargs) -> list[float]:
    sizes = [len(ids) for ids in completion_ids] if completion_ids is not None else [len(text_of(c).split()) for c in completions]
    return [-(n - target) / target if n > target else 0.0 for n in sizes]


BUILTINS: dict[str, Callable] = {"exact_answer": exact_answer, "think_format": think_format, "length": length}


def reward_functions(entries, system: str | None = None) -> tuple[list[Callable], list[float]]:
    """The recipe's `rewards:` as TRL reward functions (each checked, each named) and their weights."""
    funcs = []
    for i, entry in enumerate(entries):
        key = f"rewards.{i}"
        if entry.name is not None:
            builtin = BUILTINS[entry.name]
            _check_args(builtin, entry.args, f"{key}.args")
            func, label = _bound(builtin, entry.args), entry.name
        elif entry.function is not None:
            func, label = load_function(entry.function, f"{key}.function"), entry.function.rsplit(":", 1)[1]
        else:
            from erniekit_lite.model.reward import load_reward_model

            func, label = load_reward_model(entry.model, system=system), "reward_model"
        funcs.append(_checked(func, label, key))
    names = [f.__name__ for f in funcs]
    for i, name in enumerate(names):
        if names.count(name) > 1:  # TRL logs rewards/<name>/mean: two entries must not share a name
            funcs[i].__name__ = f"{name}_{i}"
    return funcs, [float(e.weight) for e in entries]


def _bound(func: Callable, args: dict) -> Callable:
    def bound(*positional, **kwargs):
        return func(*positional, **{**kwargs, **args})

    return bound


def _check_args(func: Callable, args: dict, key: str) -> None:
    import inspect

    accepted = [p for p, v in inspect.signature(func).parameters.items() if v.kind is v.KEYWORD_ONLY or
                (v.default is not inspect.Parameter.empty and p not in ("answer", "completion_ids"))]
    for name, value in args.items():
        if name not in accepted:
            raise UserError(f"{key}: unknown argument {name!r} for {func.__name__}; expected "
                            f"{', '.join(accepted) or 'none'}")
        if name == "target" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"{key}.target: expected a whole number of tokens, at least 1 (got {value!r})")


def load_function(spec: str, key: str) -> Callable:
    """`package.module:function` (imported) or `path/to/file.py:function` (loaded from the file)."""
    where, _, name = spec.rpartition(":")
    expected = "expected 'package.module:function' or 'path/to/file.py:function'"
    try:
        if where.endswith(".py") or "/" in where or "\\" in where:
            path = Path(where).expanduser()
            if not path.is_file():
                raise UserError(f"{key}: {spec!r}: no file {path}; {expected}")
            module_name = f"erniekit_reward_{abs(hash(str(path.resolve())))}"
            loader = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except UserError:
        raise
    except Exception as e:  # the user's module failed to import: say which and why, in one line
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"{key}: cannot import {where!r} ({type(e).__name__}{': ' + reason if reason else ''}); {expected}") from None
    func = getattr(module, name, None)
    if not callable(func):
        raise UserError(f"{key}: {where!r} has no function {name!r}; {expected}")
    return func


def _checked(func: Callable, label: str, key: str) -> Callable:
    """`func` with its return checked: one float or None per completion."""

    def reward(prompts=None, completions=None, **kwargs):
        values = func(prompts=prompts, completions=completions, **kwargs)
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            shown = f"{len(values)} values" if isinstance(values, (list, tuple)) else repr(values)[:60]
            raise UserError(f"{key} ({label}): returned {shown} for {len(completions)} completions; expected a list "
                            "of one float (or None) per completion")
        out = []
        for j, value in enumerate(values):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise UserError(f"{key} ({label}): returned {value!r} for completion {j}; expected a float (or None)")
            if value is not None and not math.isfinite(float(value)):
                raise UserError(f"{key} ({label}): returned {value!r} for completion {j}; expected a finite float")
            out.append(None if value is None else float(value))
        return out

    reward.__name__ = label
    return reward
