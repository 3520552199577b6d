"""What a run's `progress.jsonl` (written by the training callbacks) says: step, ETA, curves, and how it ended."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from erniekit_lite.plots import headline_keys
from erniekit_lite.train.callbacks import PROGRESS


@dataclass
class Progress:
    started: bool = False  # the training loop has begun (data and model are loaded)
    step: int = 0
    max_steps: int = 0
    start_time: float = 0.0  # of the start event (time.time() of the training process)
    last_time: float = 0.0  # of the last event
    logs: list[dict] = field(default_factory=list)  # the "log" events, in order
    end: dict | None = None  # the "end" event: status finished|stopped, checkpoint

    @property
    def eta(self) -> float | None:
        """Seconds left at the pace so far; None before the first logged step."""
        if not self.step or self.end is not None:
            return None
        return (self.last_time - self.start_time) / self.step * max(0, self.max_steps - self.step)

    def curve(self, *keys: str):
        """Long-format frame (step, value, series) of the logged `keys`, for gr.LinePlot."""
        import pandas as pd

        rows = [(e["step"], e[k], k) for e in self.logs for k in keys if isinstance(e.get(k), (int, float))]
        return pd.DataFrame(rows, columns=["step", "value", "series"])

    def headline(self, method: str):
        """The curve of `method`'s headline metrics (erniekit_lite.plots.HEADLINE), training and eval; empty for a
        method whose headline is the loss."""
        return self.curve(*headline_keys(method, {k for e in self.logs for k in e}))


def read(out_dir: Path, since: float) -> Progress:
    """The progress of the run in `out_dir` that started at or after `since` (a time.time()).

    Every run in a dir appends to the same file (a resumed run too), so earlier runs' events are skipped.
    """
    events = _events(Path(out_dir) / PROGRESS)
    starts = [i for i, e in enumerate(events) if e.get("event") == "start" and e.get("time", 0) >= since]
    if not starts:
        return Progress()
    events = events[starts[-1] :]
    last = events[-1]
    return Progress(
        started=True,
        step=last.get("step", 0),
        max_steps=last.get("max_steps", 0),
        start_time=events[0].get("time", 0),
        last_time=last.get("time", 0),
        logs=[e for e in events if e.get("event") == "log"],
        end=last if last.get("event") == "end" else None,
    )


def _events(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    events = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # the line the trainer is writing right now
            continue
    return events
