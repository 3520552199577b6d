"""The run directory contract.

    OUTPUT_DIR/
      recipe.yaml            the resolved recipe (file + overrides), written before training starts
      model or adapter       safetensors + config (full) or adapter_model.safetensors + adapter_config.json (LoRA)
      tokenizer files, chat template, generation_config.json
      train_results.json     train_loss, train_runtime, train_tokens, train_tokens_per_second, packing_efficiency
      trainer_state.json     per-step log_history
      samples.jsonl          answers to output.sample_prompts, when set
      checkpoint-N/          intermediate checkpoints (Trainer), each complete (see checkpoints.py)
      tmp-checkpoint-N/      a save in progress, or what a killed one left (removed when training starts)

A non-empty directory is reused only for the same resolved recipe and only while unfinished, so a second run
never silently overwrites the first; `output.overwrite: true` clears it first, except when resuming: the
checkpoints to resume from are never deleted. Resuming may change the schedule (`SCHEDULE_KEYS`: more steps or
epochs, another logging/saving/eval cadence), which also extends a finished run: its final model and metrics are
then replaced because the user asked with --resume, and its checkpoints stay. Anything else (model, data, method,
LoRA, optimizer) must be what the run was started with.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from erniekit_lite.errors import UserError
from erniekit_lite.recipe import Recipe

# train: keys a resumed run may change: how long it trains and how often it logs, saves and evaluates
SCHEDULE_KEYS = (
    "max_steps", "num_train_epochs", "logging_steps", "logging_strategy", "save_steps", "save_strategy",
    "save_total_limit", "eval_steps", "eval_strategy",
)


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
            log(f"output.overwrite: clearing {out}")
            for child in out.iterdir():
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        out.mkdir(parents=True, exist_ok=True)
        (out / "recipe.yaml").write_text(_identity(recipe), encoding="utf-8")
    state.wait_for_everyone()
    return out


def _identity(recipe: Recipe) -> str:
    # The overwrite flag is how the user answers the question, and resuming is how the same run goes on:
    # neither is part of what the run is
    train = {k: v for k, v in recipe.train.items() if k != "resume_from_checkpoint"}
    return recipe.model_copy(update={"output": recipe.output.model_copy(update={"overwrite": False}), "train": train}).to_yaml()
