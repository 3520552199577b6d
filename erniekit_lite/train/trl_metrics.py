"""Metrics kept on the device between logging steps, read back in one transfer when a step logs.

The project's own per-micro-batch metrics (token accuracy, the router losses, the MoE aux loss) are appended to TRL's
metric lists as detached device tensors; the Trainer's `log` (step.py) calls `read_back`, which replaces them by Python
numbers at once. TRL's own preference losses (DPO, KTO, ORPO/SimPO, the reward model) compute their metrics inside the
loss function with `.item()`, boolean masks and `count > 0` tests: those reads are TRL's and are left to it (each a
short wait after the forward on a GPU; docs/performance.md counts them).
"""

from __future__ import annotations

import torch


def read_back(kept: list[dict]) -> None:
    """Metrics kept as device tensors between logging steps (a `.item()` per micro-batch stalled the GPU each time),
    in `kept` (metric name -> list of values), replaced by Python numbers: one transfer per kind. Counts (TRL's token
    counter) come back as integers: through float32 they are exact only below 2^24."""
    held = [(values, i) for metrics in kept for values in metrics.values() for i, v in enumerate(values) if torch.is_tensor(v)]
    parts = {kind: [(values, i) for values, i in held if values[i].is_floating_point() == (kind is torch.float32)]
             for kind in (torch.float32, torch.int64)}  # split before either is read (reading replaces the tensors)
    for kind, these in parts.items():
        if these:
            read = torch.stack([values[i].detach().to(kind).reshape(()) for values, i in these]).tolist()
            for (values, i), value in zip(these, read):
                values[i] = value
