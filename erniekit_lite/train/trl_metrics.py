"""TRL's per-micro-batch metrics kept on the device until a logging step reads them (issue 44).

TRL's preference trainers compute each micro-batch's metrics (rewards, log-probs, accuracies, entropy, token counts)
in the same function as its loss and read each one back with `.item()`: on a GPU a wait for the device per value,
ten to twenty per micro-batch. While that function runs in training, `.item()` called from it returns the value as a
detached 0-d tensor instead; TRL's metric lists then hold device tensors, and `read_back` (called by the
Trainer's `log`, step.py) reads them all back in one transfer when the step logs. Only TRL's loss functions (`TRL_LOSSES`, in `trl.` modules) are given
tensors: the model's forward and every other caller get Python numbers as always.

What this cannot move: a tensor TRL tests as a Python bool (its `count > 0` guards in DPO and KTO), boolean-mask
indexing in its DPO and KTO metrics, and KTO's split of a batch by label (`nonzero`) are still read at once; they sit
in TRL's own code, between its loss and its metrics.
"""

from __future__ import annotations

import contextlib
import sys

import torch

TRL_LOSSES = ("compute_loss", "_compute_loss", "get_batch_loss_metrics")  # DPO, KTO, RM; ORPO and CPO


def _item(tensor: torch.Tensor):
    caller = sys._getframe(1)
    if caller.f_code.co_name in TRL_LOSSES and caller.f_globals.get("__name__", "").startswith("trl."):
        return tensor.detach()
    return torch._C.TensorBase.item(tensor)


@contextlib.contextmanager
def metrics_on_device():
    """Within: `.item()` called by TRL's loss functions returns the detached 0-d tensor (see the module doc)."""
    torch.Tensor.item = _item
    try:
        yield
    finally:
        del torch.Tensor.item  # the inherited method again


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
