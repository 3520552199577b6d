"""The run directory contract.

    OUTPUT_DIR/
      recipe.yaml            the resolved recipe (file + overrides), written before training starts
      model or adapter       safetensors + config (full) or adapter_model.safetensors + adapter_config.json (LoRA)
      tokenizer files, chat template, generation_config.json
      train_results.json     train_loss, train_runtime, train_tokens, train_tokens_per_second, packing_efficiency
      trainer_state.json     per-step log_history
      samples.jsonl          answers to output.sample_prompts, when set
      ema/                   with train.ema: the same format (model or adapter, tokenizer, recipe.yaml, metrics)
                             holding the EMA of the trained weights (train/ema.py)
      checkpoint-N/          intermediate checkpoints (Trainer), each complete (see checkpoints.py)
      tmp-checkpoint-N/      a save in progress, or what a killed one left (removed when training starts)

A non-empty directory is reused only for the same resolved recipe and only while unfinished, so a second run
never silently overwrites the first; `output.overwrite: true` replaces it, except when resuming: the checkpoints to
resume from are never deleted. Overwrite replaces only a run: a folder holding a `recipe.yaml` that parses as a
recipe and otherwise only what this contract lists (`RUN_FILES`, `RUN_DIRS`), and that neither is nor holds the
working folder, the model or the data; anything else is refused in one line naming what is there. The old run is
moved aside (`.NAME.replaced-PID`) and deleted when the new run's first optimizer step has finished; a failure
before that puts it back. Resuming may change the schedule (`SCHEDULE_KEYS`: more steps or
epochs, another logging/saving/eval cadence), which also extends a finished run: its final model and metrics are
then replaced because the user asked with --resume, and its checkpoints stay. Anything else (model, data, method,
LoRA, optimizer) must be what the run was started with.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
from pathlib import Path

import yaml

from erniekit_lite.errors import UserError
from erniekit_lite.recipe import Recipe, load

# train: keys a resumed run may change: how long it trains and how often it logs, saves and evaluates
SCHEDULE_KEYS = (
    "max_steps", "num_train_epochs", "logging_steps", "logging_strategy", "save_steps", "save_strategy",
    "save_total_limit", "eval_steps", "eval_strategy",
)


# What a run dir may hold besides recipe.yaml (the contract above, and the result files later features add)
RUN_FILES = ("*.safetensors", "*.json", "*.jsonl", "*.jinja", "*.png", "*.md", "training_args.bin", "tokenizer.model")
RUN_DIRS = re.compile(r"(tmp-)?checkpoint-\d+|runs|ema")
_aside: Path | None = None  # the run an overwrite moved aside, until the new run's first step (claim, first_step_done)


def not_a_run(out: Path, recipe: Recipe) -> str | None:
    """Why `out` is not an earlier run overwrite may replace, or None."""
    here = Path.cwd().resolve()
    target = out.resolve()
    guarded = [("the working folder", here), ("the model", Path(recipe.model.path).expanduser())]
    guarded += [("the data", Path(str(getattr(source, "path", source))).expanduser()) for source in recipe.data.train]
    for what, path in guarded:
        if not path.exists():
            continue
        path = path.resolve()
        if path == target or target in path.parents:
            return f"is or holds {what} ({path})"
    if not (out / "recipe.yaml").is_file():
        return f"holds no recipe.yaml ({_first_names([p.name for p in out.iterdir()])})"
    try:
        load(str(out / "recipe.yaml"), [])
    except UserError:  # the recipe module says why it is not a recipe
        return "holds a recipe.yaml that is not a recipe"
    others = [p.name for p in out.iterdir() if p.name != "recipe.yaml" and not (
        RUN_DIRS.fullmatch(p.name) if p.is_dir() else any(fnmatch.fnmatch(p.name, pattern) for pattern in RUN_FILES))]
    if others:
        return f"holds {_first_names(others)}, which no run writes"
    return None


def _first_names(names: list[str]) -> str:
    names = sorted(names)
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


def check(recipe: Recipe) -> bool:
    """Raise if the run may not use its output dir; True when the dir must be cleared first (overwrite)."""
    out = Path(recipe.output.dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"output.dir: {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        previous = out / "recipe.yaml"
        same = previous.is_file() and previous.read_text(encoding="utf-8") == _identity(recipe)
        finished = (out / "train_results.json").is_file()
        resuming = recipe.train.get("resume_from_checkpoint") not in (None, False)
        if recipe.output.overwrite and not resuming:
            reason = not_a_run(out, recipe)
            if reason:
                raise UserError(f"output.overwrite: {out} is not an earlier run: it {reason}; nothing was removed "
                                "(choose another output.dir)")
            return True
        if not same and resuming:
            if not previous.is_file():
                raise UserError(f"output.dir: {out} holds no recipe.yaml: not a run this recipe can resume")
            schedule_changes(recipe, previous)  # raises when more than the schedule changed
            if finished:
                from erniekit_lite.train.checkpoints import complete

                if not complete(out):
                    raise UserError(f"output.dir: {out} holds a finished run without a checkpoint to continue from "
                                    "(its train.save_steps never came); train it again with output.overwrite=true")
            return False
        if not same:
            reason = not_a_run(out, recipe)
            if reason:  # overwrite would not replace it either: no advice to set it
                raise UserError(f"output.dir: {out} is not empty and not a run: it {reason}; choose another output.dir")
            raise UserError(
                f"output.dir: {out} is not empty and holds a different run; choose another output.dir "
                "or set output.overwrite=true to replace it"
            )
        if finished and resuming:
            raise UserError(f"output.dir: {out} already holds a finished run of this recipe: there is nothing to resume "
                            "(to train it longer, resume with a larger train.max_steps or train.num_train_epochs)")
        if finished:
            raise UserError(f"output.dir: {out} already holds a finished run of this recipe; set output.overwrite=true to train again")
    return False


def schedule_changes(recipe: Recipe, previous: Path) -> list[str]:
    """`key: old -> new` for each schedule key a resumed recipe changes; a UserError naming any other change."""
    old = yaml.safe_load(previous.read_text(encoding="utf-8"))
    new = yaml.safe_load(_identity(recipe))
    old_train, new_train = old.pop("train", {}) or {}, new.pop("train", {}) or {}
    others = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    others += sorted(f"train.{k}" for k in set(old_train) | set(new_train)
                     if k not in SCHEDULE_KEYS and old_train.get(k) != new_train.get(k))
    if others:
        raise UserError(f"output.dir: {recipe.output.dir} holds a run of a different recipe ({', '.join(others)} changed); "
                        f"resuming may change only the schedule (train.{', train.'.join(SCHEDULE_KEYS)})")
    return [f"train.{k}: {old_train.get(k, 'default')} -> {new_train.get(k, 'default')}"
            for k in SCHEDULE_KEYS if old_train.get(k) != new_train.get(k)]


def claim(recipe: Recipe, log=print) -> Path:
    """Make the output dir this run's: clear it if asked, write the resolved recipe.

    In a launched run every process calls this and the main one claims, between two barriers: no process is
    still in `check` while the dir changes, and none goes on before it is ready.
    """
    from accelerate import PartialState

    state = PartialState()  # already set up by the TrainingArguments: the launched run's process group
    out = Path(recipe.output.dir)
    state.wait_for_everyone()
    if state.is_main_process:
        previous = out / "recipe.yaml"
        if recipe.train.get("resume_from_checkpoint") not in (None, False) and previous.is_file():
            changed = schedule_changes(recipe, previous)
            if changed:
                log(f"resume: {'; '.join(changed)}. The Trainer rebuilds the learning-rate schedule for the new length "
                    "and goes on from the checkpoint's step in it (a decaying schedule rises again to where the longer "
                    "run would be at that step)" + ("; the finished run's model and metrics will be replaced, its "
                    "checkpoints stay" if (out / "train_results.json").is_file() else ""))
        if check(recipe):
            global _aside
            _aside = out.with_name(f".{out.name}.replaced-{os.getpid()}")
            shutil.rmtree(_aside, ignore_errors=True)
            out.rename(_aside)
            log(f"output.overwrite: the earlier run in {out} moved to {_aside}; deleted when the first step has finished")
        out.mkdir(parents=True, exist_ok=True)
        (out / "recipe.yaml").write_text(_identity(recipe), encoding="utf-8")
    state.wait_for_everyone()
    return out


def _identity(recipe: Recipe) -> str:
    # The overwrite flag is how the user answers the question, and resuming is how the same run goes on:
    # neither is part of what the run is
    train = {k: v for k, v in recipe.train.items() if k != "resume_from_checkpoint"}
    return recipe.model_copy(update={"output": recipe.output.model_copy(update={"overwrite": False}), "train": train}).to_yaml()


def first_step_done() -> None:
    """The new run trained a step: the run it replaces goes (main process; nothing to do elsewhere)."""
    global _aside
    if _aside is not None:
        shutil.rmtree(_aside, ignore_errors=True)
        _aside = None


def put_back(out: Path, log=print) -> None:
    """The new run failed before its first step: the earlier run returns to its place."""
    global _aside
    if _aside is not None and _aside.is_dir():
        shutil.rmtree(out, ignore_errors=True)
        _aside.rename(out)
        log(f"output.overwrite: the run failed before its first step; the earlier run is back in {out}")
    _aside = None

