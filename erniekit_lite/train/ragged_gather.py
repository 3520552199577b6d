"""`accelerator.gather` for tensors whose first dimension differs between processes, and `gather_for_metrics` that
drops accelerate's evening-out rows in the units the tensors count.

TRL's preference trainers gather per-pair values for their metrics (`rewards/chosen`, `logps/*`, ...) with
`accelerator.gather` / `gather_for_metrics`, and the Trainer's evaluation loop gathers each batch's loss repeated
once per sequence; both assume every process holds a batch of the same size, as TRL's padded batches do. A packed
row holds a variable number of pairs, so two processes hold different counts, and the mismatched all-gather aborted
the run (gloo: "Received data size doesn't match expected size"). Here the sizes are gathered first; unequal
tensors are padded to the largest, gathered, and the padding cut out, so the metrics are the means over every
process's pairs, as TRL means them.

At the end of a dataloader accelerate evens out the last batch with rows from the start and `gather_for_metrics`
cuts the gathered result to its `remainder`, which counts rows, not pairs. Here each process instead cuts its own
tensor before the gather, to the pairs of its rows that are not repeats (`last_rows`: the pairs of each row of the
micro-batch being scored, or None when it is not the dataloader's last); a tensor of m blocks of those pairs (TRL's
chosen-then-rejected [2B] layout) is cut block by block, one of a value per row (the evaluation loop's loss) row by
row, a scalar kept or dropped with its process's rows; any other tensor is gathered whole. Both are public methods of
accelerate's `Accelerator`, overridden in a subclass that becomes the trainer's accelerator's class (`install`).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from erniekit_lite.classes import same_named


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


def real_part(rows: list[int], remainder: int, process: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """This process's tensor without the pairs of its repeated rows: process p's rows are the global rows
    [p*b, (p+1)*b) of the last batch, and the first `remainder` of those are real."""
    kept_rows = min(max(remainder - process * len(rows), 0), len(rows))
    held, kept = sum(rows), sum(rows[:kept_rows])

    def cut(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:
            return tensor[None][: int(kept_rows > 0)]
        if tensor.shape[0] == len(rows):  # one value per row (the evaluation loop's loss)
            return tensor[:kept_rows]
        if tensor.shape[0] % held == 0:
            blocks = tensor.reshape(tensor.shape[0] // held, held, *tensor.shape[1:])
            return blocks[:, :kept].reshape(-1, *tensor.shape[1:])
        return tensor  # not counted in these pairs: kept whole

    return cut


def install(accelerator, last_rows: Callable[[], list[int] | None], trainer=None) -> None:
    """Every gather of this accelerator takes ragged tensors (a collective more per gather of a non-scalar), and
    `gather_for_metrics` (also the `trainer`'s `gather_function`) drops repeated rows' pairs at a dataloader's end:
    the accelerator's class becomes `ragged_class` of its own (named as it is). `last_rows` as the module doc says."""
    if accelerator.num_processes == 1:
        return
    accelerator.__class__ = ragged_class(type(accelerator))
    accelerator.last_rows = last_rows
    if trainer is not None:  # the Trainer's evaluation loop took accelerate's in its __init__, before this
        trainer.gather_function = functools.partial(accelerator.gather_for_metrics, use_gather_object=trainer.args.eval_use_gather_object)


@functools.cache
def ragged_class(cls: type) -> type:
    """accelerate's Accelerator class `cls` whose `gather` and `gather_for_metrics` (public methods, overridden) are
    the module doc's."""
    from accelerate.utils import recursively_apply

    def gather(self, tensor):
        return ragged(functools.partial(cls.gather, self))(tensor)

    def gather_for_metrics(self, data, use_gather_object=False):
        try:
            recursively_apply(lambda x: x, data, error_on_other_type=True)
        except TypeError:
            use_gather_object = True
        if use_gather_object:
            return cls.gather_for_metrics(self, data, use_gather_object=True)  # objects: accelerate's own
        rows, remainder = self.last_rows(), self.gradient_state.remainder
        if rows is not None and remainder > 0:
            # the batches' index: under distributed.sequence_parallel, the data-parallel group's (sequence_parallel.py)
            group = self.process_index // getattr(self, "sequence_parallel", 1)
            data = recursively_apply(real_part(rows, remainder, group), data)
        return self.gather(data)  # never cut again in rows: not the last batch, or cut above

    # last_rows: the pairs of each row of the micro-batch being scored when it is a dataloader's last, else None
    return same_named(cls, __name__, gather=gather, gather_for_metrics=gather_for_metrics,
                      last_rows=staticmethod(lambda: None))
