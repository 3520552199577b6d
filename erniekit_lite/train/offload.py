"""`train.offload` (docs/offload.md): training state in host memory, for a GPU smaller than the plan.

- `optimizer`: `HostStep` keeps an fp32 master of each trained parameter, its gradient and the optimizer's states on
  the host; each optimizer step copies the gradients there, steps on the CPU (torch's own optimizer, fused AdamW by
  default) and copies the weights back. The device keeps the weights and their gradients. Under DDP every process
  steps its own copy of the averaged gradients. A bf16 model trains with fp32 masters, as DeepSpeed's offload does;
  an fp32 model trains exactly as without offload (tests/test_offload.py).
- `parameters`: FSDP2's `CPUOffloadPolicy`: every sharded weight, gradient and optimizer state lives on the host,
  and each unit is copied to the device as it runs. `erniekit-lite train` launches it (one FSDP2 process unless
  --num-processes says more; `--fsdp_offload_params true`, which also gives the process group the CPU backend
  that clipping and sharded checkpoints need on CUDA).
- `auto`: decided when the run starts, on the GPU it runs on: the first of none and optimizer (under FSDP2, none and
  parameters) whose plan fits the memory free there and the host's; on a machine without a GPU, none. Decided by the run plan (run_plan.py) before the model loads.

DeepSpeed has its own offload (`offload_optimizer_device`, `offload_param_device` in its config), so train.offload
refuses to run under it. The plan (memory.py) counts the host memory each mode takes; a run that would not fit the
host is refused before the model loads.
"""

from __future__ import annotations

import torch

from erniekit_lite import memory
from erniekit_lite.errors import UserError
from erniekit_lite.run_plan import OFFLOAD_APPLIED, Applied


def applied(args) -> Applied:
    return getattr(args, OFFLOAD_APPLIED, None) or Applied("none", 0)


def setup(trainer, offload: Applied, log=print) -> None:
    """Before training: FSDP2's policy checked (and made unpinned on CPU, where pinning needs an accelerator), and a
    callback that records what the offloaded state holds on the host (train_results.json, `distributed.offload`)."""
    from transformers import TrainerCallback

    mode = offload.mode
    if mode == "none":
        return
    if mode == "parameters":
        from torch.distributed.fsdp import CPUOffloadPolicy

        plugin = trainer.accelerator.state.fsdp_plugin
        if plugin is None or not isinstance(plugin.cpu_offload, CPUOffloadPolicy):
            raise UserError("train.offload: parameters: this FSDP run was launched without --fsdp_offload_params true "
                            "(or fsdp_offload_params: true in its accelerate config)")
        if not torch.cuda.is_available() and plugin.cpu_offload.pin_memory:
            plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    planned = offload.host_bytes
    log(f"train.offload: {mode}: in host memory {memory.HOST_HELD[mode]}, about {memory.size(planned)} per process by "
        "the plan")

    class Held(TrainerCallback):
        """The bytes the offloaded state holds in host memory once the optimizer has first stepped (its state exists;
        nothing is added later): sizes only, nothing read from the device."""

        def on_optimizer_step(self, args, state, control, **kwargs):
            report = getattr(trainer, "distribution", None)
            if report is None or "offload_host_bytes" in report:
                return
            report["offload"] = mode
            if mode == "parameters":  # the policy fully_shard was given, read back from the model's FSDP state
                report["offload_policy"] = fsdp_policy(trainer.model)
            report["offload_host_bytes"] = host_bytes(trainer)
            report["offload_host_bytes_planned"] = planned

    trainer.add_callback(Held())


def host_bytes(trainer) -> int:
    """What the offloaded state occupies in host memory in this process: the host step's masters, gradient copies and
    states, or FSDP2's local shards of the weights, their gradients and the optimizer states."""
    step = host_step(trainer.optimizer)
    if step is not None:
        return step.held_bytes()
    from torch.distributed.tensor import DTensor

    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    tensors = [local(p) for p in trainer.model.parameters()]
    tensors += [local(p.grad) for p in trainer.model.parameters() if p.grad is not None]
    tensors += [local(v) for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cpu")


def fsdp_policy(model) -> str:
    from torch.distributed.fsdp import FSDPModule

    groups = (m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule))
    return type(next(g for g in groups if g is not None).offload_policy).__name__


def host_step(optimizer) -> HostStep | None:
    while optimizer is not None and not isinstance(optimizer, HostStep):
        optimizer = getattr(optimizer, "optimizer", None)  # accelerate's wrapper
    return optimizer


class HostStep(torch.optim.Optimizer):
    """An optimizer stepped on the CPU: `inner` (built by the Trainer for the model's parameters, its state still
    empty) gets fp32 host masters in place of the parameters, each with an fp32 gradient buffer; `step` copies the
    gradients in, steps `inner` there, and copies the masters back to the parameters. The learning-rate schedule
    and LoRA+'s groups stay `inner`'s own (`param_groups` is its list).

    Like accelerate's `AcceleratedOptimizer`, a wrapper: `Optimizer.__init__` is not run (the scheduler checks the
    type). Its state dict is `inner`'s, plus the masters of parameters that are not fp32 once they differ from them
    (after the first step), so a resumed bf16 run keeps its fp32 weights."""

    MASTERS = "erniekit_host_masters"

    def __init__(self, inner: torch.optim.Optimizer):
        if not type(inner).__module__.startswith("torch.optim") or inner.state:  # `check_optimizer` said it for train.optim
            raise UserError(f"train.offload: optimizer steps torch's own optimizers on the CPU; {type(inner).__name__} "
                            "is not one: use train.optim adamw_torch_fused (the default), adamw_torch or sgd")
        self.inner = inner
        pin = torch.cuda.is_available()  # page-locked: the copies run asynchronously
        self.pairs: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = []
        for group in inner.param_groups:
            masters = []
            for p in group["params"]:
                master = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
                master.copy_(p.detach())
                masters.append(master)
                self.pairs.append((p, master, torch.empty_like(master, pin_memory=pin)))
            group["params"] = masters
        self.stepped = False
        self._norm = torch.empty(1, dtype=torch.float32, device="cpu", pin_memory=pin)
        self._norm_check = None  # (the step's gradient norm on the device, what checks it on the host)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @property
    def defaults(self):
        return self.inner.defaults

    def check_norm(self, grad_norm: torch.Tensor, check) -> None:
        """`check(norm as a float)` runs in the next `step` before anything is applied: the norm is copied with the
        gradients and read after the one wait the step makes anyway (the divergence guard, checkpoints.py)."""
        self._norm_check = (grad_norm, check)

    @torch.no_grad()
    def step(self, closure=None):
        norm_check, self._norm_check = self._norm_check, None
        if norm_check is not None:
            self._norm.copy_(norm_check[0].detach().float().reshape(1), non_blocking=True)
        for p, master, grad in self.pairs:
            if p.grad is None:  # not used this step: the inner optimizer skips it
                master.grad = None
                continue
            grad.copy_(p.grad, non_blocking=True)
            master.grad = grad
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the gradients have arrived (one wait per optimizer step)
        if norm_check is not None:
            norm_check[1](float(self._norm))  # a host buffer: no wait of its own; raises before any update
        self.inner.step()
        for p, master, _ in self.pairs:
            p.copy_(master, non_blocking=True)
        self.stepped = True

    def zero_grad(self, set_to_none: bool = True):
        for p, _, _ in self.pairs:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def held_bytes(self) -> int:
        tensors = [t for _, master, grad in self.pairs for t in (master, grad)]
        tensors += [v for s in self.inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def state_dict(self):
        state = self.inner.state_dict()
        if self.stepped:
            state[self.MASTERS] = {i: master for i, (p, master, _) in enumerate(self.pairs) if p.dtype != torch.float32}
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        masters = state_dict.pop(self.MASTERS, None)
        self.inner.load_state_dict(state_dict)  # torch puts each state on its master's device: the host
        for i, (p, master, _) in enumerate(self.pairs):
            if masters is not None and i in masters:
                master.copy_(masters[i])
            else:
                master.copy_(p.detach())  # an fp32 parameter is its own master (loaded from the checkpoint already)
        self.stepped = self.stepped or bool(masters)

    def __repr__(self) -> str:
        return f"HostStep({self.inner!r})"
