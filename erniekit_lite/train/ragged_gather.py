"""`accelerator.gather` for tensors whose first dimension differs between processes.

TRL's preference trainers gather per-pair values for their metrics (`rewards/chosen`, `logps/*`, ...) with
`accelerator.gather` / `gather_for_metrics`, which assume every process holds a batch of the same size, as TRL's
padded batches do. A packed row holds a variable number of pairs, so two processes hold different counts, and the
mismatched all-gather aborted the run (gloo: "Received data size doesn't match expected size"). Here the sizes are
gathered first; unequal tensors are padded to the largest, gathered, and the padding cut out, so the metrics are the
means over every process's pairs, as TRL means them.
"""

from __future__ import annotations

import torch


def ragged(gather):
    def gather_ragged(tensor):
        if not torch.is_tensor(tensor) or tensor.dim() == 0 or not torch.distributed.is_initialized():
            return gather(tensor)
        sizes = gather(torch.tensor([tensor.shape[0]], device=tensor.device)).tolist()
        top = max(sizes)
        if min(sizes) == top:
            return gather(tensor)
        padded = torch.cat([tensor, tensor.new_zeros((top - tensor.shape[0], *tensor.shape[1:]))])
        gathered = gather(padded)
        return torch.cat([gathered[i * top: i * top + n] for i, n in enumerate(sizes)])

    return gather_ragged


def install(accelerator) -> None:
    """Every gather of this accelerator takes ragged tensors (a collective more per gather of a non-scalar)."""
    if accelerator.num_processes > 1 and not getattr(accelerator, "_erniekit_ragged", False):
        accelerator.gather = ragged(accelerator.gather)
        accelerator.gather_for_metrics = ragged(accelerator.gather_for_metrics)
        accelerator._erniekit_ragged = True
