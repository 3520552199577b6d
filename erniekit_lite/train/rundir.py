"""The run directory contract.

    OUTPUT_DIR/
      recipe.yaml            the resolved recipe (file + overrides), written before training starts, its first line
                             `MARK` with the digest of the rest: a run's, told from a recipe of the user's (`written`)
      model or adapter       safetensors + config (full) or adapter_model.safetensors + adapter_config.json (LoRA)
      tokenizer files, chat template, generation_config.json; a VL run's image processor (preprocessor_config.json)
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
recipe and otherwise only what runs write (`RUN`: each name as its writer fixes it, a checkpoint only when all it
holds is in `CHECKPOINT`), and that neither is nor holds the working folder, the model, the data (train and eval)
or a reward model or function; anything else is refused in one line naming what is there, and nothing is removed.
A `recipe.yaml` no run wrote (the user's own recipe, naming its own folder as output.dir) makes a folder neither a run
nor a start that never trained: it is never replaced, and the folder never taken or emptied.
While a run lives it holds its folder (train/run_lock.py, taken by the `train` command before `check`): its lock file,
`.NAME.lock`, is beside the folder, never in it, so nothing here (the tables, the aside, `never_trained`) sees it.
The old run is moved aside (`.NAME.replaced-<pid>-<unique>`) and deleted when the new run's first optimizer step has
finished; a failure before that puts it back. An aside that a killed run left is named at the next start of a
run in that folder, with how to get it back. Resuming may change the schedule (`SCHEDULE_KEYS`: more steps or
epochs, another logging/saving/eval cadence), which also extends a finished run: its final model and metrics are
then replaced because the user asked with --resume, and its checkpoints stay. Anything else (model, data, method,
LoRA, optimizer) must be what the run was started with.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from erniekit_lite.errors import UserError
from erniekit_lite.files import unique
from erniekit_lite.recipe import Recipe, load
from erniekit_lite.rewards import reward_file

# train: keys a resumed run may change: how long it trains and how often it logs, saves and evaluates
SCHEDULE_KEYS = (
    "max_steps", "num_train_epochs", "logging_steps", "logging_strategy", "save_steps", "save_strategy",
    "save_total_limit", "eval_steps", "eval_strategy",
)

# The first line of the recipe.yaml a run writes (`claim`), with the start of the sha256 of the rest: a recipe of the
# user's, even one copied from a run and edited, does not carry it (`written`)
MARK = "# erniekit-lite train: the resolved recipe of the run in this folder (sha256 {digest})\n"



@dataclass(frozen=True)
class Names:
    """What one folder of a run may hold: file names as their writers fix them, patterns only where a writer makes
    the name up, and folders (by pattern) with what each of those may hold."""

    files: frozenset[str] = frozenset()
    patterns: tuple[str, ...] = ()
    dirs: tuple[tuple[str, Names], ...] = ()

    def strangers(self, folder: Path, prefix: str = "") -> list[str]:
        """What in `folder` (recursively) no run writes, as paths relative to the run."""
        found = []
        for p in sorted(folder.iterdir()):
            name = prefix + p.name
            if p.is_symlink():  # no writer below makes links
                found.append(name)
            elif p.is_dir():
                inner = next((names for pattern, names in self.dirs if re.fullmatch(pattern, p.name)), None)
                found += [name + "/"] if inner is None else inner.strangers(p, name + "/")
            elif not (p.name in self.files or any(re.fullmatch(pattern, p.name) for pattern in self.patterns)):
                found.append(name)
            elif p.name == "README.md" and not _model_card(p):
                found.append(name)
        return found


def _model_card(path: Path) -> bool:
    """A README.md a run wrote: erniekit-lite's card (hub.CARD_MARK), or the card TRL's or peft's save writes (YAML
    front matter naming the library); any other README.md is the user's."""
    from erniekit_lite.hub import CARD_MARK

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    if text.startswith(CARD_MARK):
        return True
    head, sep, _ = text.removeprefix("---\n").partition("\n---\n")
    try:
        meta = yaml.safe_load(head) if text.startswith("---\n") and sep else None
    except yaml.YAMLError:
        return False
    return isinstance(meta, dict) and "library_name" in meta


# The names runs write, by writer, read at transformers 5.23, peft 0.21.2, TRL 1.16, accelerate 1.15, DeepSpeed 0.19
# and torch 2.13. A name no writer here writes (the user's notes, data, scripts) makes a folder not a run.
# save_pretrained of a model (full or sharded), a peft adapter, a tokenizer, and generation settings
SAVED = frozenset({
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "training_args.bin",
    "README.md",  # TRL's (and peft's) model card, or erniekit-lite's (hub.after_training): _model_card
    # ERNIE-4.5-VL: its image processor's save (train/run.py, model/merge.py), and what a processor's save adds beside
    # it (its own settings, the video processor's, a chat template in the processor's legacy JSON form)
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json", "chat_template.json",
})
SAVED_PATTERNS = (r"model-\d{5}-of-\d{5}\.safetensors",)  # transformers' shards
# torch's distributed checkpoint (FSDP's SHARDED_STATE_DICT, accelerate): one file per rank and the metadata
DCP = Names(frozenset({".metadata"}), (r"__\d+_\d+\.distcp",))
# A checkpoint-N/: the Trainer's save (+ the model's above), FSDP's and DeepSpeed's shards, erniekit-lite's own
CHECKPOINT = Names(
    SAVED | {"trainer_state.json", "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth",
             "ema.safetensors",  # train/ema.py
             "latest", "zero_to_fp32.py", "zero_to_torch.py"},  # DeepSpeed: its newest save's tag, its recovery scripts
    SAVED_PATTERNS + (r"rng_state_\d+\.pth",  # one per process
                      r"sync-rank\d+\.pt",  # train/sync.py, one per process
                      r"erniekit_totals(-rank\d+)?\.json",  # train/step.py: the run's totals (per process before they were summed)
                      r"grpo_generation_state_\d+\.pt"),  # train/grpo_trainer.py, one per process
    ((r"pytorch_model_fsdp_\d+|optimizer_\d+", DCP),
     (r"global_step\d+", Names(patterns=(r"(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_(model|optim)_states\.pt",
                                        r"mp_rank_\d+_model_states\.pt")))),
)
# What the run dir's own saves write (train/callbacks.py, sft.py, expert_load.py, plots.py, hub.py), also in ema/
RESULTS = SAVED | {"trainer_state.json", "train_results.json", "all_results.json", "eval_results.json",
                   "recipe.yaml", "samples.jsonl", "loss.png", "expert_load.json", "expert_load.png", "progress.jsonl"}
RUN = Names(
    RESULTS,
    SAVED_PATTERNS,
    ((r"checkpoint-\d+", CHECKPOINT),
     (r"tmp-checkpoint-\d+", Names(dirs=((r"checkpoint-\d+", CHECKPOINT),))),  # a save in progress (checkpoints.py)
     ("ema", Names(RESULTS, SAVED_PATTERNS)),  # train/ema.py
     ("eval", Names(patterns=(r"eval_results(-\d+)?\.json", r"eval_generations(-\d+)?\.jsonl"))),  # `eval` (evaluate.py)
     # TensorBoard (report_to): transformers' default_logdir, runs/<Mon>DD_HH-MM-SS_<host>/, one events file a writer
     ("runs", Names(dirs=((r"[A-Z][a-z]{2}\d{2}_\d{2}-\d{2}-\d{2}_.+", Names(patterns=(r"events\.out\.tfevents\..+",))),)))),
)


@dataclass(frozen=True)
class Target:
    """The output dir a recipe names, with what deciding about it needs: read from the recipe once (`target`)."""

    out: Path
    identity: str  # the recipe.yaml this run writes (`_identity`)
    overwrite: bool
    resuming: bool
    guarded: tuple[tuple[str, Path], ...]  # what an overwrite must never remove: the recipe's model, data, rewards


def target(recipe: Recipe) -> Target:
    guarded = [("the model", Path(recipe.model.path).expanduser())]
    for section in ("train", "eval"):
        guarded += [("the data", Path(str(getattr(source, "path", source))).expanduser())
                    for source in getattr(recipe.data, section) or []]
    for entry in recipe.rewards or []:
        if entry.model is not None:
            guarded.append(("a reward model", Path(entry.model).expanduser()))
        file = reward_file(entry.function) if entry.function is not None else None
        if file is not None:
            guarded.append(("a reward function", file))
    return Target(Path(recipe.output.dir), _identity(recipe), recipe.output.overwrite,
                  recipe.train.get("resume_from_checkpoint") not in (None, False), tuple(guarded))


def not_a_run(out: Path, run: Target) -> str | None:
    """Why `out` is not an earlier run overwrite may replace, or None."""
    target = out.resolve()
    for what, path in (("the working folder", Path.cwd().resolve()), *run.guarded):
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
    if not written(out / "recipe.yaml"):
        return _users(out)
    others = RUN.strangers(out)
    if others:
        return f"holds {_first_names(others)}, {BESIDE}"
    return None


BESIDE = "which no run writes"  # not_a_run's reason for a run with files of the user's beside it


def _refusal(out: Path, reason: str, overwrite: bool) -> str:
    """The one line refusing `out` (not_a_run's `reason`): a run with files of the user's in it is a run still, and
    the line says which files to move out; anything else is not a run."""
    if not reason.endswith(BESIDE):
        if overwrite:
            return f"output.overwrite: {out} is not an earlier run: it {reason}; nothing was removed (choose another output.dir)"
        return f"output.dir: {out} is not empty and not a run: it {reason}; choose another output.dir"
    names = reason.removeprefix("holds ").removesuffix(f", {BESIDE}")
    if overwrite:
        return (f"output.overwrite: {out} holds an earlier run and also {names}, {BESIDE}: move those out of it to "
                "replace the run; nothing was removed")
    return (f"output.dir: {out} holds another run and also {names}, {BESIDE}; choose another output.dir (or move those "
            "out and set output.overwrite=true)")


def _users(out: Path) -> str:
    return f"holds {out / 'recipe.yaml'}, which no run wrote (a recipe of your own is never replaced)"


def written(path: Path) -> bool:
    """Whether `path`, a folder's recipe.yaml, is the resolved recipe a run wrote there (`claim`): its first line is
    `MARK` with the digest of the rest, or (a run's from before the mark) it is its own resolved recipe. A recipe of
    the user's (comments, keys left to their defaults, a run's copied and edited) is neither."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    if text == _marked(text.partition("\n")[2]):
        return True
    try:
        return _identity(load(str(path), [])) == _marked(text)
    except UserError:
        return False


def _first_names(names: list[str]) -> str:
    names = sorted(names)
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


def check(run: Target) -> bool:
    """Raise if the run may not use its output dir; True when the dir must be cleared first (overwrite)."""
    out = run.out
    if out.exists() and not out.is_dir():
        raise UserError(f"output.dir: {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        previous = out / "recipe.yaml"
        # a run's from before the mark (`written`) is the same run too
        same = previous.is_file() and previous.read_text(encoding="utf-8") in (run.identity,
                                                                              run.identity.partition("\n")[2])
        finished = (out / "train_results.json").is_file()
        resuming = run.resuming
        if not resuming and never_trained(out):
            return True  # a start that failed or was stopped before its first step: nothing of a run to keep
        if run.overwrite and not resuming:
            reason = not_a_run(out, run)
            if reason:
                raise UserError(_refusal(out, reason, overwrite=True))
            return True
        if not same and resuming:
            if not previous.is_file():
                raise UserError(f"output.dir: {out} holds no recipe.yaml: not a run this recipe can resume")
            if not written(previous):
                raise UserError(f"output.dir: {out} is not a run this recipe can resume: it {_users(out)}; "
                                "choose another output.dir")
            schedule_changes(run, previous)  # raises when more than the schedule changed
            if finished:
                from erniekit_lite.train.checkpoints import complete

                if not complete(out):
                    raise UserError(f"output.dir: {out} holds a finished run without a checkpoint to continue from "
                                    "(its train.save_steps never came); train it again with output.overwrite=true")
            return False
        if not same:
            reason = not_a_run(out, run)
            if reason:  # overwrite would not replace it either: no advice to set it alone
                raise UserError(_refusal(out, reason, overwrite=False))
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


def never_trained(out: Path) -> bool:
    """Whether `out` holds only what a run writes when it claims its folder (recipe.yaml, progress.jsonl's start)
    and never trained a step: a start that failed (a setting refused by the workers, Ctrl-C while loading). Such a
    folder is not a run, and the next start takes it. A recipe.yaml that no run wrote (`written`) is the user's."""
    import json

    names = {p.name for p in out.iterdir()}
    if "recipe.yaml" not in names or not names <= {"recipe.yaml", "progress.jsonl"}:
        return False
    if not written(out / "recipe.yaml"):
        return False
    try:
        lines = (out / "progress.jsonl").read_text(encoding="utf-8").splitlines() if "progress.jsonl" in names else []
        return not any(json.loads(line).get("step", 0) for line in lines if line.strip())
    except (OSError, ValueError, AttributeError):
        return False


def schedule_changes(run: Target, previous: Path) -> list[str]:
    """`key: old -> new` for each schedule key a resumed recipe changes; a UserError naming any other change."""
    old = yaml.safe_load(previous.read_text(encoding="utf-8"))
    new = yaml.safe_load(run.identity)
    old_train, new_train = old.pop("train", {}) or {}, new.pop("train", {}) or {}
    others = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    others += sorted(f"train.{k}" for k in set(old_train) | set(new_train)
                     if k not in SCHEDULE_KEYS and old_train.get(k) != new_train.get(k))
    if others:
        raise UserError(f"output.dir: {run.out} holds a run of a different recipe ({', '.join(others)} changed); "
                        f"resuming may change only the schedule (train.{', train.'.join(SCHEDULE_KEYS)})")
    return [f"train.{k}: {old_train.get(k, 'default')} -> {new_train.get(k, 'default')}"
            for k in SCHEDULE_KEYS if old_train.get(k) != new_train.get(k)]


@dataclass
class Claimed:
    """An output dir this run has claimed (`claim`), and the earlier run an overwrite moved aside (main process only),
    kept until the new run's first optimizer step: then deleted, or put back if the run fails before it."""

    out: Path
    aside: Path | None = None

    def first_step_done(self) -> None:
        """The new run trained a step: the run it replaces goes (nothing to do where nothing was moved aside)."""
        aside, self.aside = self.aside, None
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)

    def put_back(self, log=print) -> None:
        """The new run failed before its first step: the earlier run returns to its place. Called while that failure
        propagates, so it never raises itself: a put-back that fails says where the earlier run is."""
        aside, self.aside = self.aside, None
        if aside is None or not aside.is_dir():
            return
        try:
            shutil.rmtree(self.out, ignore_errors=True)
            aside.rename(self.out)
        except OSError as e:
            log(f"output.overwrite: the run failed before its first step, and the earlier run could not be put back "
                f"({e}); it is in {aside}: move it to {self.out} by hand")
            return
        log(f"output.overwrite: the run failed before its first step; the earlier run is back in {self.out}")


def claim(run: Target, log=print) -> Claimed:
    """Make the output dir this run's: clear it if asked (moving the earlier run aside), write the resolved recipe.

    In a launched run every process calls this and the main one claims, between two barriers: no process is
    still in `check` while the dir changes, and none goes on before it is ready.
    """
    from accelerate import PartialState

    state = PartialState()  # already set up by the TrainingArguments: the launched run's process group
    claimed = Claimed(run.out)
    out = claimed.out
    state.wait_for_everyone()
    if state.is_main_process:
        previous = out / "recipe.yaml"
        if run.resuming and previous.is_file():
            changed = schedule_changes(run, previous)
            if changed:
                log(f"resume: {'; '.join(changed)}. The Trainer rebuilds the learning-rate schedule for the new length "
                    "and goes on from the checkpoint's step in it (a decaying schedule rises again to where the longer "
                    "run would be at that step)" + ("; the finished run's model and metrics will be replaced, its "
                    "checkpoints stay" if (out / "train_results.json").is_file() else ""))
        for left in leftovers(out):
            log(f"output.dir: {left} holds an earlier run that an overwrite moved aside and a killed run left there; "
                f"to get it back, move it to a new name (mv {left} {out.with_name(out.name + '-earlier')}), or delete it")
        unstarted = out.is_dir() and any(out.iterdir()) and never_trained(out)
        if check(run):
            claimed.aside = unique(out, "replaced")  # two overwrites never share one
            out.rename(claimed.aside)
            log(f"output.dir: {out} held a start that never trained a step; taken for this run" if unstarted else
                f"output.overwrite: the earlier run in {out} moved to {claimed.aside}; deleted when the first step has finished")
        out.mkdir(parents=True, exist_ok=True)
        (out / "recipe.yaml").write_text(run.identity, encoding="utf-8")
    state.wait_for_everyone()
    return claimed


def _identity(recipe: Recipe) -> str:
    # The overwrite flag is how the user answers the question, and resuming is how the same run goes on:
    # neither is part of what the run is
    train = {k: v for k, v in recipe.train.items() if k != "resume_from_checkpoint"}
    return _marked(recipe.model_copy(update={"output": recipe.output.model_copy(update={"overwrite": False}),
                                             "train": train}).to_yaml())


def _marked(text: str) -> str:
    return MARK.format(digest=hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]) + text


def leftovers(out: Path) -> list[Path]:
    """Earlier runs of `out` moved aside by an overwrite whose run was killed before it could delete or put them back."""
    return sorted(p for p in out.parent.glob(f".{out.name}.replaced-*") if p.is_dir())
