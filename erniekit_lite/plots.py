"""loss.png: the training (and eval) loss of a run, drawn from the log_history the Trainer saves in trainer_state.json;
and `HEADLINE`, what each method logs that says how it goes besides the loss."""

from __future__ import annotations

import json
from pathlib import Path

# Each method's headline metrics: the Trainer's log keys (TRL's names; evaluation logs them with an `eval_` prefix).
# The web UI's live plot and loss.png show them next to the loss. sft and pt: the loss is the headline. A method missing here
# shows the loss alone; the keys are not checked against the recipe's methods, so an entry may come first.
HEADLINE: dict[str, tuple[str, ...]] = {
    "sft": (),
    "pt": (),
    "dpo": ("rewards/accuracies", "rewards/margins"),
    "orpo": ("rewards/accuracies", "rewards/margins"),
    "simpo": ("rewards/accuracies", "rewards/margins"),
    "kto": ("rewards/margins", "kl"),  # KTO logs no accuracy: its examples are unpaired
    "rm": ("accuracy", "margin"),
    # GRPO: the mean weighted reward, each reward function's mean (TRL names them rewards/NAME/mean), the completion
    # length, and the KL to the reference (logged only with beta > 0); its loss is near zero by construction
    "grpo": ("reward", "rewards/*/mean", "completions/mean_length", "kl"),
}


def headline_keys(method: str, logged=()) -> tuple[str, ...]:
    """The log keys of `method`'s headline metrics, the training ones then their evaluation twins; a `*` pattern
    (GRPO's per-reward means) stands for each of the `logged` keys it matches."""
    keys = _expand(HEADLINE.get(method, ()), logged)
    return (*keys, *(f"eval_{k}" for k in keys))


def _expand(keys, logged) -> tuple[str, ...]:
    import fnmatch

    logged = sorted(set(logged))
    return tuple(k for key in keys for k in (fnmatch.filter(logged, key) if "*" in key else [key]))


def panels(history: list[dict], method: str | None = None) -> list[tuple[str, dict[str, list[tuple[int, float]]]]]:
    """What loss.png draws from a log_history: (title, {"train" | "eval": [(step, value), ...]}) for the loss, then
    for each headline metric of `method` (HEADLINE) that was logged. Without `method`, the first HEADLINE entry whose
    first metric was logged is taken (dpo, orpo and simpo log the same ones); none matching: the loss alone."""
    def points(key: str) -> list[tuple[int, float]]:
        return [(h["step"], h[key]) for h in history if isinstance(h.get(key), (int, float))]

    logged = {k for h in history for k in h}
    if method is None:
        method = next((m for m, keys in HEADLINE.items() if keys and keys[0] in logged), "sft")  # in HEADLINE's order
    out = []
    for key in ("loss", *_expand(HEADLINE.get(method, ()), logged)):
        curves = {label: found for label, found in (("train", points(key)), ("eval", points(f"eval_{key}"))) if found}
        if curves:
            out.append((key, curves))
    return out


def write_loss_plot(run_dir: str | Path, path: str | Path | None = None, method: str | None = None) -> Path | None:
    """Draw the run's loss curve, and beside it the method's headline metrics (`panels`), to `path` (default
    RUN_DIR/loss.png); None when no loss was logged."""
    state = Path(run_dir) / "trainer_state.json"
    if not state.is_file():
        return None
    drawn = panels(json.loads(state.read_text(encoding="utf-8")).get("log_history", []), method)
    if not drawn or drawn[0][0] != "loss":
        return None

    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    columns = min(3, len(drawn))
    rows = -(-len(drawn) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(7 if columns == 1 else 5 * columns, 4 * rows), squeeze=False)
    for ax, (title, curves) in zip(axes.flat, drawn):
        for label, found in curves.items():
            steps, values = zip(*found)
            ax.plot(steps, values, marker="o" if len(found) < 30 else None, label=label)  # few points: show each
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(drawn):]:
        ax.set_visible(False)
    fig.tight_layout()
    out = Path(path) if path is not None else Path(run_dir) / "loss.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
