"""GRPO reward functions: the built-ins, and the recipe's `rewards:` entries made into TRL reward functions.

A TRL reward function is called once per generation batch as `f(prompts=, completions=, completion_ids=, **columns)`
and returns one float (or None: "does not apply", which TRL averages out) per completion. Here `prompts` are message
lists, `completions` one-message lists `[{"role": "assistant", "content": text}]`, and the data's reference answers
arrive as `answer=[...]` (None where a record has none); TRL also passes `trainer_state`, `log_extra`, `log_metric`.
erniekit-lite adds `prompt_text=[...]`: each prompt as the run's template rendered it for generation, control tokens
spelled out (ERNIE-4.5-21B-A3B-Thinking's ends in `<|im_start|>assistant\n<think>\n`, so its completions start inside
the reasoning).

Built-ins (`name:`):
- `exact_answer`: 1.0 when the completion's final answer equals the reference's, else 0.0 (None, left out of TRL's
  means, without a reference or when the reference has no final answer to read).
  The answer is read after the reasoning (`</think>`), inside the last `<response>...</response>` when there is one
  (the Thinking template's wrapping); a completion whose reasoning never closes (it opened `<think>`, or its prompt
  did) has no answer and scores 0.0. A final answer is the last `\\boxed{...}`, else what follows the last `####`
  (GSM8K), else the whole text when it is only numbers and separators (a comma list is an answer only so, boxed or
  after ####), else the last number in the prose, where `1,234` (a comma, then exactly three digits) is one number and
  `3, 45` or `2019,250` two ("So by day 3, 45 birds are left." answers 45); numbers compare as numbers (`1,234` =
  `1234.0`: commas only as thousands separators), a list as its text (`2, 3,5` = `2,3,5`, not 235), anything else as
  stripped text.
- `think_format`: 1.0 for a well-formed reasoning + answer, else 0.0. After a prompt that opens `<think>` (the
  Thinking template's), that is reasoning, `</think>`, then an answer, with no `<think>` of its own; after one that
  does not, or with no prompt to read (`prompt_text`, else `prompts` when they are strings), exactly one
  `<think>...</think>` then an answer. Reasoning and answer must be non-empty. It reads the text TRL decodes with
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

# A number, or a comma list of numbers ("2, 3, 5"): a list of 3-digit groups is one number with thousands commas
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)(?:\s*,\s*-?(?:\d+(?:\.\d+)?|\.\d+))*")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_ONLY_NUMBERS = re.compile(r"[-+$\d.,\s]*\d[-+$\d.,\s]*")
# One number in prose: thousands commas only as a comma and exactly three digits (1,234), so "day 3, 45" is 3 and 45;
# a minus only at a word's start ("pages 12-15" ends on 15, not -15); an exponent whole ("1.2e3" is 1200, not 3)
_PROSE_NUMBER = re.compile(r"(?:(?<!\w)-)?(?:\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")


def text_of(completion) -> str:
    """A completion's text: TRL passes a string (plain prompts) or a one-message list (chat prompts)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    return str(completion)


def opens_thinking(prompt: str | None) -> bool:
    """Whether a rendered prompt leaves the completion inside a reasoning block (it ends in an unclosed `<think>`)."""
    return prompt is not None and prompt.rstrip().endswith("<think>")


def answer_part(text: str, prompt: str | None = None) -> str | None:
    """What follows the reasoning, inside the last <response>...</response> when present; None when the reasoning
    never closed (the completion or its prompt opened `<think>` and no `</think>` follows)."""
    if "</think>" not in text and ("<think>" in text or opens_thinking(prompt)):
        return None
    text = text.rsplit("</think>", 1)[-1]
    start = text.rfind("<response>")
    if start >= 0:
        text = text[start + len("<response>"):].split("</response>", 1)[0]
    return text


def final_answer(text: str) -> str | None:
    """The answer a text ends on: the last \\boxed{...}, else after the last ####, else the whole text when it is
    only numbers and separators, else the last number in the prose."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return _normal(boxed)
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        return _normal(after.splitlines()[0]) if after else None
    if _ONLY_NUMBERS.fullmatch(text):
        return _normal(text)
    numbers = _PROSE_NUMBER.findall(text)
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
    """Numbers as numbers (thousands commas, a leading $ and a trailing period or .0 dropped); other answers stripped."""
    answer = answer.strip().removeprefix("$").rstrip(".").strip()
    if "," in answer and not _THOUSANDS.fullmatch(answer) and _NUMBER.fullmatch(answer):
        return ",".join(part.strip() for part in answer.split(","))  # a list compares as text, spacing aside
    plain = answer.replace(",", "") if _THOUSANDS.fullmatch(answer) else answer
    try:
        value = float(plain)
    except ValueError:
        return answer
    return str(int(value)) if value.is_integer() else repr(value)


def _prompts(completions, prompt_text=None, prompts=None) -> list[str | None]:
    """Each completion's rendered prompt: `prompt_text`, else `prompts` when TRL passes them as strings, else None."""
    if prompt_text is not None:
        return list(prompt_text)
    if prompts is not None and all(isinstance(p, str) for p in prompts):
        return list(prompts)
    return [None] * len(completions)


def exact_answer(completions, answer=None, prompt_text=None, prompts=None, **kwargs) -> list[float | None]:
    references = answer if answer is not None else [None] * len(completions)
    out: list[float | None] = []
    for completion, reference, prompt in zip(completions, references, _prompts(completions, prompt_text, prompts)):
        if reference is None or not str(reference).strip():
            out.append(None)
            continue
        want = final_answer(str(reference))
        if want is None:  # a reference with no number, #### or \boxed{} has nothing this reward can compare
            out.append(None)
            continue
        said = answer_part(text_of(completion), prompt)
        got = final_answer(said) if said is not None else None
        out.append(1.0 if got is not None and got == want else 0.0)
    return out


_THINK = re.compile(r"\s*<think>(?P<reasoning>.*?)</think>(?P<answer>.*)", re.DOTALL)


def think_format(completions, prompt_text=None, prompts=None, **kwargs) -> list[float]:
    out = []
    for completion, prompt in zip(completions, _prompts(completions, prompt_text, prompts)):
        text = text_of(completion)
        if opens_thinking(prompt):  # the prompt opened the reasoning: the completion only closes it
            text = "<think>" + text if "<think>" not in text else "<think><think>"  # opening it again is malformed
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

    # what TRL and the trainer pass at each call is not a recipe setting
    accepted = [p for p, v in inspect.signature(func).parameters.items() if v.kind is v.KEYWORD_ONLY or
                (v.default is not inspect.Parameter.empty and p not in ("answer", "completion_ids", "prompt_text", "prompts"))]
    for name, value in args.items():
        if name not in accepted:
            raise UserError(f"{key}: unknown argument {name!r} for {func.__name__}; expected "
                            f"{', '.join(accepted) or 'none'}")
        if name == "target" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"{key}.target: expected a whole number of tokens, at least 1 (got {value!r})")


def reward_file(spec: str) -> Path | None:
    """The file a `path/to/file.py:function` reward is loaded from; None for `package.module:function`."""
    where = spec.rpartition(":")[0]
    return Path(where).expanduser() if where.endswith(".py") or "/" in where or "\\" in where else None


def load_function(spec: str, key: str) -> Callable:
    """`package.module:function` (imported) or `path/to/file.py:function` (loaded from the file)."""
    where, _, name = spec.rpartition(":")
    expected = "expected 'package.module:function' or 'path/to/file.py:function'"
    try:
        path = reward_file(spec)
        if path is not None:
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
