"""`erniekit-lite eval TARGET --tasks ...`: standard benchmarks (MMLU, CMMLU, C-Eval, GSM8K, ...) through
lm-evaluation-harness.

lm-eval does everything that makes a benchmark figure comparable: the task's prompts, few-shot examples, answer
extraction and metrics. erniekit-lite only loads the model the way `chat` does (a run dir with LoRA adapters on
every MoE expert, which plain peft cannot load; base + `--adapter`; a merged dir; a Hub id) and hands lm-eval the
loaded model (`HFLM(pretrained=<model>)`).

`--chat` renders each request with the tokenizer's chat template (the released ERNIE template, which erniekit-lite
also writes into every tiny and tuned checkpoint). lm-eval tokenizes the rendered string whole; training tokenizes
the prompt and the answer apart (`data/template.py`), so the `▁` after `Assistant: ` is its own token there. For
`generate_until` tasks that is the same prompt (the rendered string ends in that space); for log-likelihood tasks
lm-eval moves the context's trailing space into the continuation, so each choice is scored as `▁A`, not `▁` + `A`:
a tokenization the tuned model never saw after `Assistant:`.
"""

from __future__ import annotations

import difflib
import json
import math
from contextlib import contextmanager, nullcontext
from pathlib import Path

from erniekit_lite.errors import UserError

# A task over local data that ships in the package: `--tasks-path EXAMPLE_TASKS --tasks erniekit_example`
EXAMPLE_TASKS = Path(__file__).resolve().parent / "eval_tasks"


def run_tasks(
    target: str,
    tasks: list[str],
    adapter: str | None = None,
    tasks_path: str | None = None,
    num_fewshot: int | None = None,
    limit: float | None = None,
    batch_size: int = 8,
    chat: bool = False,
    compare: str | None = None,
    out: str | None = None,
    log=print,
    samples: bool = False,
) -> dict:
    """Evaluate `target` (and `compare`, the base, when given) on lm-eval `tasks`; write and return the results."""
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1 (got {batch_size})")
    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num-fewshot must be 0 or more (got {num_fewshot})")
    if limit is not None and limit <= 0:
        raise UserError(f"--limit must be above 0: a count of examples per task, or a fraction below 1 (got {limit})")
    names = [t.strip() for t in tasks if t.strip()]
    if not names:
        raise UserError("--tasks: no task named (expected e.g. --tasks mmlu,gsm8k)")
    manager = task_manager(tasks_path, names)
    check_tasks(manager, names)
    from erniekit_lite.evaluate import output_paths

    results_path, _ = output_paths(out, False)
    settings = {"tasks": names, "tasks_path": tasks_path, "num_fewshot": num_fewshot, "limit": limit, "batch_size": batch_size, "chat": chat}
    offline = hub_unreachable()
    runs = {"tuned" if compare else "model": evaluate_one(target, adapter, manager, settings, log, samples, offline)}
    if compare:
        runs["base"] = evaluate_one(compare, None, manager, settings, log, samples, offline)
    results = {"lm_eval": lm_eval_version(), **settings, "target": target, "adapter": adapter, "compare": compare,
               "runs": {k: {key: v for key, v in r.items() if key != "samples"} for k, r in runs.items()}}
    rows = table_rows(runs["tuned"]["results"], runs["base"]["results"]) if compare else table_rows(runs["model"]["results"])
    results["table"] = rows
    results_path.write_text(json.dumps(results, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    log(format_table(rows, compare is not None))
    log(f"eval: wrote {results_path}")
    if samples:  # per-example records (tests); not written: MMLU alone has 14k
        results["samples"] = {k: r["samples"] for k, r in runs.items()}
    return results


def task_manager(tasks_path: str | None, tasks: list[str]):
    """lm-eval's task index: the YAMLs under `tasks_path` (lm-eval's format) and lm-eval's own tasks.

    When every requested name is one of the local YAMLs, lm-eval's ~15k built-in tasks are not indexed (seconds).
    """
    if tasks_path is not None and not Path(tasks_path).is_dir():
        raise UserError(f"--tasks-path: {tasks_path}: no such directory (expected a folder of lm-eval task YAMLs)")
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError("--tasks needs lm-evaluation-harness: pip install 'erniekit-lite[eval]' (lm-eval 0.4.13)") from None
    if tasks_path is not None:
        local = TaskManager(include_path=tasks_path, include_defaults=False)
        if all(local.match_tasks([name]) for name in tasks):
            return local
    return TaskManager(include_path=tasks_path)


def check_tasks(manager, names: list[str]) -> None:
    """Each name a task, group or tag lm-eval knows (globs allowed); one line for the first that is not."""
    known = manager.all_tasks
    for name in names:
        if not manager.match_tasks([name]):
            close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
            hint = f"; close names: {', '.join(close)}" if close else "; `lm-eval ls tasks` lists them"
            raise UserError(f"--tasks: lm-eval has no task, group or tag named {name!r}{hint}")


def hub_unreachable() -> bool:
    """Whether the Hub cannot be reached (or HF_HUB_OFFLINE says not to try): one quick request, where a task's
    download would retry for half a minute before failing."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return True
    try:
        get_session().head(constants.ENDPOINT, timeout=5)  # the session honours HF_ENDPOINT and proxies as downloads do
    except Exception:  # any transport failure: a download would fail the same way
        return True
    return False


@contextmanager
def offline_datasets(names: list[str]):
    """Hub downloads off for lm-eval's call: datasets then reads its cache, and fails at once where it has nothing,
    a failure given as one line naming `--tasks-path`."""
    from unittest import mock

    import datasets
    from huggingface_hub import constants

    with mock.patch.object(constants, "HF_HUB_OFFLINE", True), mock.patch.object(datasets.config, "HF_HUB_OFFLINE", True):
        try:
            yield
        except ConnectionError as e:  # datasets: "Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)"
            reason = " ".join(str(e).split()).removesuffix(" (OfflineModeIsEnabled)")
            raise UserError(f"--tasks {','.join(names)}: the Hugging Face Hub cannot be reached and a task's data is not in the "
                            f"datasets cache ({reason}); run it once online, or evaluate local task files with --tasks-path DIR "
                            f"(an example: --tasks-path {EXAMPLE_TASKS} --tasks erniekit_example)") from None


def not_metadata_hint(record) -> bool:
    """lm-eval suggests its own CLI's `--metadata` for a task with its own loader (the shipped example): not ours."""
    return "--metadata" not in record.getMessage()


def evaluate_one(target: str, adapter: str | None, manager, settings: dict, log, samples: bool, offline: bool = False) -> dict:
    """One model through `lm_eval.simple_evaluate`, loaded as `chat` loads it and released afterwards."""
    import gc
    import logging

    import torch
    from unittest import mock

    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from erniekit_lite.chat import load

    log(f"eval: {target}{f' + {adapter}' if adapter else ''} on {', '.join(settings['tasks'])}")
    model, tokenizer = load(target, adapter)
    model.config.use_cache = True
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings["batch_size"], backend="causal")
    logging.getLogger("lm_eval.api.task").addFilter(not_metadata_hint)  # once: addFilter skips one already there
    # lm-eval records `git describe` of the working directory, which says nothing of the model and prints
    # "fatal: not a git repository" outside one
    hub = offline_datasets(settings["tasks"]) if offline else nullcontext()
    with mock.patch("lm_eval.evaluator.get_git_commit_hash", return_value=None), hub:
        output = simple_evaluate(
            model=lm,
            tasks=settings["tasks"],
            num_fewshot=settings["num_fewshot"],
            limit=settings["limit"],
            task_manager=manager,
            apply_chat_template=settings["chat"],
            fewshot_as_multiturn=settings["chat"] and bool(settings["num_fewshot"]),
            log_samples=samples,
        )
    del lm, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    keep = ("results", "groups", "group_subtasks", "n-shot", "versions", "higher_is_better", "n-samples")
    return {**{k: output.get(k) for k in keep}, "samples": output.get("samples")}


def table_rows(tuned: dict, base: dict | None = None) -> list[dict]:
    """One row per task and metric (lm-eval's `metric,filter` names; standard errors left out)."""
    rows = []
    for task, metrics in tuned.items():
        for key, value in metrics.items():
            # metrics are "name,filter" (acc,none; exact_match,strict-match); alias, sample_len and stderrs are not
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            row = {"task": task, "metric": key, "value": value}
            if base is not None:
                before = base.get(task, {}).get(key)
                row = {"task": task, "metric": key, "base": before, "tuned": value,
                       "difference": value - before if isinstance(before, (int, float)) else None}
            rows.append(row)
    return rows


def format_table(rows: list[dict], compared: bool) -> str:
    def number(x) -> str:
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"

    if compared:
        lines = ["| task | metric | base | tuned | difference |", "| --- | --- | ---: | ---: | ---: |"]
        signed = lambda x: "n/a" if x is None else f"{x:+.4f}"  # noqa: E731
        lines += [f"| {r['task']} | {r['metric']} | {number(r['base'])} | {number(r['tuned'])} | {signed(r['difference'])} |" for r in rows]
    else:
        lines = ["| task | metric | value |", "| --- | --- | ---: |"]
        lines += [f"| {r['task']} | {r['metric']} | {number(r['value'])} |" for r in rows]
    return "\n".join(lines)


def lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")
