"""`distributed.sync`: how the processes of a multi-process (DDP) run agree on the update, for machines joined by a
slow link (docs/distributed.md).

- `every_step`: DDP as it is, every gradient all-reduced every optimizer step.
- `bf16`: the same all-reduce of the gradients cast to bfloat16 and back (half the bytes). torch's
  `bf16_compress_hook` refuses gloo; `bf16_hook` is its arithmetic (cast, divide, all-reduce, cast back) on any backend.
- `powersgd`: torch's PowerSGD hook, each gradient matrix sent as rank-R factors with error feedback and warm start,
  compressing from the third optimizer step (torch's least `start_powerSGD_iter`, 2: DDP regroups its buckets after
  the first step, which PowerSGD's per-bucket state must not span) and every matrix whose factors are smaller than
  it (torch's defaults send plain all-reduce for 1,000 steps and every matrix the factors would not shrink 2×). DDP
  runs one gradient bucket and no search for unused parameters (`trainer_args`): the hook starts its later
  all-reduces from the communication thread, and DDP's unused-parameter map or another bucket's all-reduce then
  started in a different order on the two processes over gloo ("collective mismatch", seen within five steps).
- `local_sgd`: no gradient all-reduce; each process steps on its own gradients and every H optimizer steps (and at
  the end) the trained parameters are averaged, one all-reduce per dtype. accelerate's `LocalSGD` averages every
  parameter (a LoRA run's whole frozen base) one tensor at a time and wants the loop under its `no_sync`; here the
  loop is the Trainer's, so DDP's gradient sync is switched off instead. Optimizer states are each process's own.

Resume is exact: each process writes what only it holds into the checkpoint (`sync-rank<R>.pt`): PowerSGD's error
feedback, warm-start factors and random state, by parameter name (DDP's buckets after a resume differ from those
before it for one step, so torch's per-bucket state would not fit), and local_sgd's optimizer state (but rank 0's,
which is the checkpoint's optimizer.pt). The file holds tensors and plain numbers only (PowerSGD's numpy random
state as its key tensor and numbers) and is loaded with `weights_only=True`: a file that needs more (written before
that, or not by erniekit-lite) is refused in one line naming it, never unpickled. local_sgd
checkpoints fall on sync points (the recipe check: save_steps a multiple of H), except a stop's, which then holds each
process's own trained parameters too.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import TrainerCallback

from erniekit_lite.errors import UserError

FILE = "sync-rank{}.pt"


def setup(trainer, plan, log=print):
    """`distributed.sync` on the trainer (`trainer.sync`, which checkpoints and resume read); None for every_step."""
    from accelerate.utils import DistributedType

    section = plan.sync
    if section.sync == "every_step":
        return None
    # FSDP and DeepSpeed were refused with it by the run plan (`run_plan.refuse_unlaunchable`)
    if trainer.accelerator.distributed_type == DistributedType.NO:
        log(f"{section.describe()}: one process, nothing to synchronise")
        return None
    sync = Synchronised(trainer, section)
    trainer.sync = sync
    trainer.add_callback(sync)
    log(section.describe())
    return sync


class Synchronised(TrainerCallback):
    """Registers the mode on the DDP model when training begins (accelerate wraps it inside `train()`), saves and
    restores each process's state."""

    def __init__(self, trainer, section):
        self.trainer, self.section = trainer, section
        self.resume: Path | None = None  # the checkpoint training resumes from (callbacks.train sets it)
        self.powersgd: PowerSgd | None = None
        self.named: list[tuple[str, torch.Tensor]] = []  # local_sgd: the trained parameters, averaged every H steps

    def on_train_begin(self, args, state, control, **kwargs):
        ddp = self.trainer.model_wrapped
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            raise UserError(f"distributed.sync: {self.section.sync} needs DDP; this run's model is a {type(ddp).__name__}")
        if self.section.sync == "bf16":
            ddp.register_comm_hook(None, bf16_hook)
        elif self.section.sync == "powersgd":
            self.powersgd = PowerSgd(ddp, self.section.powersgd_rank)
        else:
            ddp.require_backward_grad_sync = False  # stays off: accelerate's no_sync restores what it found
            self.named = [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad]
        if self.resume is not None:
            self.load(self.resume)

    def on_step_end(self, args, state, control, **kwargs):
        if self.named and state.global_step % self.section.sync_every == 0:
            average([p for _, p in self.named])

    def on_train_end(self, args, state, control, **kwargs):
        if self.named and state.global_step % self.section.sync_every:
            average([p for _, p in self.named])  # the model saved at the end is every process's

    def save(self, checkpoint: Path) -> None:
        if self.section.sync == "bf16":
            return  # nothing of its own
        if self.powersgd is not None:
            saved = self.powersgd.state_dict()
        else:
            # rank 0's optimizer state is the checkpoint's optimizer.pt (the Trainer's), which every process loads first
            saved = {"optimizer": self.trainer.optimizer.state_dict()} if dist.get_rank() else {}
            if self.trainer.state.global_step % self.section.sync_every:
                # a stop's checkpoint between averagings: the processes' parameters differ, and the model file is rank 0's
                saved["parameters"] = {n: p.detach().cpu() for n, p in self.named}
        Path(checkpoint).mkdir(parents=True, exist_ok=True)
        torch.save(saved, Path(checkpoint) / FILE.format(dist.get_rank()))

    def load(self, checkpoint: Path) -> None:
        if self.section.sync == "bf16":
            return  # nothing of its own
        file = Path(checkpoint) / FILE.format(dist.get_rank())
        if not file.is_file():
            raise UserError(f"{checkpoint}: no {file.name}; it was saved without distributed.sync: {self.section.sync} "
                            f"or with fewer processes")
        saved = read(file)
        if self.powersgd is not None:
            self.powersgd.load_state_dict(saved)
        else:
            if "optimizer" in saved:
                self.trainer.optimizer.load_state_dict(saved["optimizer"])
            with torch.no_grad():
                for name, p in self.named if "parameters" in saved else ():
                    p.copy_(saved["parameters"][name])


def read(file: Path) -> dict:
    """A `sync-rank<R>.pt` as tensors and plain numbers (`weights_only=True`): a downloaded checkpoint is data, never
    code. One that holds anything else is refused in one line naming it."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(f"{file}: refused: it holds more than tensors and plain numbers (written before erniekit-lite "
                        "saved PowerSGD's random state as a tensor, or not by erniekit-lite), and unpickling it could "
                        "run code; resume from a checkpoint this version wrote, or with distributed.sync: every_step"
                        ) from None


def bf16_hook(process_group, bucket):
    """torch's `bf16_compress_hook` on any backend: the bucket in bfloat16, divided by the world size, summed."""
    buffer = bucket.buffer()
    group = process_group or dist.group.WORLD
    half = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(half, group=group, async_op=True).get_future()

    def back(done):
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(back)


def average(params: list[torch.Tensor]) -> None:
    """Every process's `params` replaced by their mean over the processes: one all-reduce per dtype."""
    world = dist.get_world_size()
    with torch.no_grad():
        for dtype in sorted({p.dtype for p in params}, key=str):
            group = [p for p in params if p.dtype == dtype]
            flat = torch.cat([p.data.reshape(-1) for p in group])
            dist.all_reduce(flat)
            flat.div_(world)
            for p, mean in zip(group, flat.split([p.numel() for p in group])):
                p.data.copy_(mean.view_as(p))


class PowerSgd:
    """torch's PowerSGD hook, its per-bucket state kept by parameter across DDP's regroupings (module docstring).

    The hook keeps, per bucket index, the error feedback (the bucket's flat gradient layout) and the warm-start Qs
    (each compressed matrix's [m, r] factor, matrices grouped by shape in first-seen order). When a bucket holds
    other parameters than last time, every bucket's state is split by parameter and rebuilt for the new buckets as
    they come; a checkpoint holds it by parameter."""

    def __init__(self, ddp, rank: int):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        self.psgd = psgd
        self.state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                        min_compression_rate=1, use_error_feedback=True, warm_start=True, random_seed=0)
        self.names = {id(p): n for n, p in ddp.module.named_parameters() if p.requires_grad}
        self.layouts: dict[int, list[tuple[str, torch.Size]]] = {}  # bucket index -> (name, shape) in bucket order
        self.carried: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}  # name -> (error, Q) between layouts
        ddp.register_comm_hook(self.state, self.hook)

    def hook(self, state, bucket):
        index = bucket.index()
        layout = [(self.names[id(p)], p.shape) for p in bucket.parameters()]
        if self.layouts.get(index) != layout:
            owned = {name for entries in self.layouts.values() for name, _ in entries}
            if index in self.layouts or any(name in owned for name, _ in layout):
                self.carry()  # DDP regrouped its buckets
            self.layouts[index] = layout
            self.place(index, layout, bucket.buffer())
        return self.psgd.powerSGD_hook(state, bucket)

    def _matrices(self, layout):
        """(name, rows, cols, rank) of the bucket's compressed matrices in the order of its Q memory."""
        by_shape: dict[tuple[int, int], list] = {}
        for name, shape in layout:
            n = shape[0]
            m = shape.numel() // n if n else 0
            r = min(n, m, self.state.matrix_approximation_rank)
            if self.psgd._should_compress(n, m, r, self.state.min_compression_rate)[0]:
                by_shape.setdefault((n, m), []).append((name, n, m, r))
        return [entry for group in by_shape.values() for entry in group]

    def by_parameter(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        out = dict(self.carried)
        for index, layout in self.layouts.items():
            if index not in self.state.error_dict:
                continue
            errors = self.state.error_dict[index].split([shape.numel() for _, shape in layout])
            qs = {}
            if index in self.state.q_memory_dict:
                matrices = self._matrices(layout)
                for (name, _, m, r), q in zip(matrices, self.state.q_memory_dict[index].split([m * r for _, _, m, r in matrices])):
                    qs[name] = q.clone()
            for (name, _), error in zip(layout, errors):
                out[name] = (error.clone(), qs.get(name))
        return out

    def carry(self) -> None:
        self.carried = self.by_parameter()
        self.layouts.clear()
        for memory in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
            memory.clear()

    def place(self, index: int, layout, buffer: torch.Tensor) -> None:
        """The bucket's state from the carried one, when it holds all its parameters; else the hook starts it fresh."""
        if not layout or any(name not in self.carried for name, _ in layout):
            return
        device, dtype = buffer.device, buffer.dtype
        self.state.error_dict[index] = torch.cat([self.carried[name][0] for name, _ in layout]).to(device, dtype)
        matrices = self._matrices(layout)
        if all(self.carried[name][1] is not None for name, *_ in matrices):
            self.state.p_memory_dict[index] = torch.empty(sum(n * r for _, n, _, r in matrices), device=device, dtype=dtype)
            self.state.q_memory_dict[index] = (torch.cat([self.carried[name][1] for name, *_ in matrices]).to(device, dtype)
                                               if matrices else torch.empty(0, device=device, dtype=dtype))
        for name, _ in layout:
            del self.carried[name]

    def state_dict(self) -> dict:
        """Tensors and plain numbers only (loaded with `weights_only=True`): the numpy random state as its parts."""
        kept = ("iter", "total_numel_before_compression", "total_numel_after_compression")
        kind, keys, pos, has_gauss, gauss = self.state.rng.get_state(legacy=True)
        rng = {"name": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
               "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}
        return {"state": {k: int(getattr(self.state, k)) for k in kept}, "rng": rng,
                "by_parameter": {name: (e.cpu(), None if q is None else q.cpu()) for name, (e, q) in self.by_parameter().items()}}

    def load_state_dict(self, saved: dict) -> None:
        for key, value in saved["state"].items():
            setattr(self.state, key, value)
        rng = saved["rng"]
        self.state.rng = np.random.RandomState()
        self.state.rng.set_state((rng["name"], rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"],
                                  rng["cached_gaussian"]))
        self.carried = saved["by_parameter"]
        self.layouts.clear()
