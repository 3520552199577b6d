"""Metrics as device sums and counts, read back only when a step logs.

Each method's loss reports, per micro-batch, a sum and a count for every metric it logs (`Parts.metrics`): a mean
over pairs is (Σ values, pairs), a mean over tokens (Σ values, tokens). They are added up on the device; at a
logging step one stack, one all-reduce over the processes and one transfer turn them into the logged means over the
whole logging window and every process (pooled, so a micro-batch of 1 pair weighs what it holds, not as much as one
of 3). A minimum or maximum (the reward model's `min_reward`, `max_reward`) is kept as such: the window's, over every
process. Nothing between two logging steps reads the device.
"""

from __future__ import annotations

import torch


class Metrics:
    def __init__(self):
        self._held: dict[str, dict[str, list]] = {"train": {}, "eval": {}}
        self._extremes: dict[str, dict[str, tuple]] = {"train": {}, "eval": {}}

    def add_extreme(self, mode: str, name: str, value: torch.Tensor, kind: str) -> None:
        """`kind` "min" or "max" of `value` (a tensor, any shape), over the window and every process."""
        value = value.detach().double().amin() if kind == "min" else value.detach().double().amax()
        held = self._extremes[mode].get(name)
        if held is not None:
            value = torch.minimum(held[1], value) if kind == "min" else torch.maximum(held[1], value)
        self._extremes[mode][name] = (kind, value)

    def add(self, mode: str, values: dict[str, tuple]) -> None:
        """`values`: name -> (sum, count), each a tensor (kept on its device, detached) or a Python number."""
        held = self._held[mode]
        for name, (total, count) in values.items():
            total = total.detach().double() if torch.is_tensor(total) else float(total)
            count = count.detach().double() if torch.is_tensor(count) else float(count)
            if name in held:
                held[name][0] = held[name][0] + total
                held[name][1] = held[name][1] + count
            else:
                held[name] = [total, count]

    def read(self, mode: str, accelerator) -> dict[str, float]:
        """The means since the last read, over every process (collective when launched: every process logs the same
        steps), and start again. A metric with no count is left out."""
        held, self._held[mode] = self._held[mode], {}
        extremes, self._extremes[mode] = self._extremes[mode], {}
        out = {}
        for kind in ("min", "max"):  # few: the reward model's two
            names = sorted(k for k, (how, _) in extremes.items() if how == kind)
            if names:
                stacked = torch.stack([extremes[k][1].reshape(()) for k in names])
                if accelerator.num_processes > 1:
                    stacked = accelerator.reduce(stacked, reduction=kind) if kind == "max" else -accelerator.reduce(-stacked, reduction="max")
                out.update(zip(names, stacked.tolist()))
        if not held and accelerator.num_processes == 1:
            return out
        names = sorted(held)
        device = accelerator.device
        parts = [torch.as_tensor(x, dtype=torch.float64, device=device).reshape(()) for name in names for x in held[name]]
        stacked = torch.stack(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)
        if accelerator.num_processes > 1:
            # every process logs the same names (the same method, the same steps), so the stacks line up
            stacked = accelerator.reduce(stacked, reduction="sum")
        values = stacked.tolist()
        for i, name in enumerate(names):
            total, count = values[2 * i], values[2 * i + 1]
            if count:
                out[name] = total / count
        return out
