"""loss.png: the training (and eval) loss of a run, drawn from the log_history the Trainer saves in trainer_state.json;
and `HEADLINE`, what each method logs that says how it goes besides the loss."""

from __future__ import annotations

import json
from pathlib import Path

# Each method's headline metrics: the Trainer's log keys (TRL's names; evaluation logs them with an `eval_` prefix).
# The web UI's live plot shows them next to the loss. sft and pt: the loss is the headline. A method missing here
# shows the loss alone; the keys are not checked against the recipe's methods, so an entry may come first.
HEADLINE: dict[str, tuple[str, ...]] = {
    "sft": (),
    "pt": (),
    "dpo": ("rewards/accuracies", "rewards/margins"),
    "orpo": ("rewards/accuracies", "rewards/margins"),
    "simpo": ("rewards/accuracies", "rewards/margins"),
    "kto": ("rewards/margins", "kl"),  # KTO logs no accuracy: its examples are unpaired
    "rm": ("accuracy", "margin"),
    "grpo": ("reward", "reward_std", "completions/mean_length", "kl"),
}


def headline_keys(method: str) -> tuple[str, ...]:
    """The log keys of `method`'s headline metrics, the training ones then their evaluation twins."""
    keys = HEADLINE.get(method, ())
    return (*keys, *(f"eval_{k}" for k in keys))


def write_loss_plot(run_dir: str | Path, path: str | Path | None = None) -> Path | None:
    """Draw the run's loss curve to `path` (default RUN_DIR/loss.png); None when no loss was logged."""
    state = Path(run_dir) / "trainer_state.json"
    if not state.is_file():
        return None
    history = json.loads(state.read_text(encoding="utf-8")).get("log_history", [])
    train = [(h["step"], h["loss"]) for h in history if "loss" in h]
    evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    if not train and not evals:
        return None

    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    for points, label in ((train, "train"), (evals, "eval")):
        if points:
            steps, losses = zip(*points)
            ax.plot(steps, losses, marker="o" if len(points) < 30 else None, label=label)  # few points: show each
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path) if path is not None else Path(run_dir) / "loss.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
