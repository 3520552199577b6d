"""How a run is distributed, said and recorded: strategy, world size, what is sharded, the precision in effect.

Read from what accelerate and the Trainer actually set up (the prepared model's parameters, the accelerator's
state), not from the config file, so a config that a machine cannot honour shows as what ran instead.

accelerate 1.15 runs FSDP and DeepSpeed only on accelerators: on CPU an FSDP config silently becomes plain data
parallelism (`AcceleratorState` keeps `MULTI_CPU` and drops the plugin), and a ZeRO-3 config breaks (transformers
has already partitioned the weights, then DDP gets them). `sharding_on_cpu` keeps the plugin there, so `fully_shard`
shards over gloo as it does over NCCL and DeepSpeed runs on its CPU accelerator; this is what lets FSDP2 and ZeRO-3
training be tested here.
"""

from __future__ import annotations

import os

SHARDING_ON_CPU = "ERNIEKIT_SHARDING_ON_CPU"  # set by `train --num-processes` on a machine without a GPU


def sharding_on_cpu() -> None:
    """Let accelerate's FSDP or DeepSpeed plugin take effect in a multi-process CPU run (see the module docstring)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__
    if getattr(init, "_erniekit", False):
        return

    def __init__(self, *args, fsdp_plugin=None, deepspeed_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, deepspeed_plugin=deepspeed_plugin, **kwargs)
        if self.distributed_type != DistributedType.MULTI_CPU:
            return
        if fsdp_plugin is not None:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
        elif deepspeed_plugin is not None and not isinstance(deepspeed_plugin, dict):
            self.distributed_type = DistributedType.DEEPSPEED
            deepspeed_plugin.set_mixed_precision(self._mixed_precision)
            deepspeed_plugin.select(_from_accelerator_state=True)
            self.deepspeed_plugins = deepspeed_plugin
            self._mixed_precision = "no"  # DeepSpeed applies it from its own config, as accelerate's init has it
        else:
            return
        PartialState._shared_state["distributed_type"] = self.distributed_type  # as accelerate's own init does

    __init__._erniekit = True
    AcceleratorState.__init__ = __init__


def enabled() -> bool:
    return os.environ.get(SHARDING_ON_CPU) == "1"


def describe(trainer) -> dict:
    """How the prepared run is distributed: strategy, world size, what is sharded (counted on the model's own
    parameters: DTensor shards under FSDP2), and the mixed precision accelerate applies."""
    from accelerate.utils import DistributedType
    from torch.distributed.tensor import DTensor

    accelerator = trainer.accelerator
    state = accelerator.state
    world = accelerator.num_processes
    params = list(trainer.model.parameters())
    # ZeRO-3 leaves each process an empty tensor per parameter and its size in `ds_numel`
    total = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    shards = sum(getattr(p, "ds_numel", p.numel()) for p in params if isinstance(p, DTensor) or hasattr(p, "ds_id"))
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params}, key=lambda d: d != "float32")
    info = {"world_size": world, "backend": str(getattr(state, "backend", None) or "none"), "parameters": total,
            "sharded_parameters": shards, "weights": " and ".join(dtypes)}
    if state.distributed_type == DistributedType.FSDP:
        plugin = state.fsdp_plugin
        info["strategy"] = f"FSDP{plugin.fsdp_version}"
        full = plugin.reshard_after_forward if plugin.fsdp_version == 2 else "FULL_SHARD" in str(plugin.sharding_strategy)
        info["sharded"] = ("parameters, gradients and optimizer state" if full else
                           "gradients and optimizer state (parameters gathered from forward to backward)") if shards else "nothing"
        info["mixed_precision"] = _fsdp_precision(trainer.model, plugin) or _autocast(accelerator)
    elif state.distributed_type == DistributedType.DEEPSPEED:
        stage = state.deepspeed_plugin.zero_stage
        info["strategy"] = f"ZeRO-{stage}"
        info["sharded"] = {3: "parameters, gradients and optimizer state", 2: "gradients and optimizer state",
                           1: "optimizer state"}.get(stage, "nothing")
        info["mixed_precision"] = _deepspeed_precision(trainer.model_wrapped)
    else:
        info["strategy"] = "DDP" if world > 1 else "single"
        info["sharded"] = "nothing (each process holds the whole model)" if world > 1 else "nothing"
        info["mixed_precision"] = _autocast(accelerator)
    return info


def _autocast(accelerator) -> str:
    # `native_amp`: accelerate wraps the model's forward in autocast (single and DDP; FSDP2 and DeepSpeed cast
    # by their own means, see the two functions below)
    return f"{accelerator.mixed_precision} autocast" if accelerator.native_amp else "none"


def _fsdp_precision(model, plugin) -> str | None:
    """FSDP's own mixed precision: FSDP2's as `fully_shard` got it (the policy on the model's FSDP state), FSDP1's
    from the plugin. Parameters are cast for compute and gradients reduced in these dtypes; the sharded weights
    and the optimizer state keep the model's dtype."""
    from torch.distributed.fsdp import FSDPModule

    policy = next((m._get_fsdp_state()._mp_policy for m in model.modules() if isinstance(m, FSDPModule)), None)
    if policy is None:
        policy = getattr(plugin, "mixed_precision_policy", None)
    compute, reduce = (getattr(policy, k, None) for k in ("param_dtype", "reduce_dtype"))
    if compute is None:
        return None
    name = lambda dtype: str(dtype).removeprefix("torch.")
    return f"FSDP {name(compute)} compute" + (f", {name(reduce)} gradient reduce" if reduce is not None else "")


def _deepspeed_precision(engine) -> str:
    """What the DeepSpeed engine runs: its bf16/fp16 modes hold the weights in that dtype, and the ZeRO optimizer a
    master copy (float32 unless configured otherwise); accelerate adds no autocast."""
    import torch

    name = lambda dtype: str(dtype).removeprefix("torch.")
    if getattr(engine, "torch_autocast_enabled", lambda: False)():
        return f"{name(engine.torch_autocast_dtype())} autocast"
    master = getattr(getattr(engine, "optimizer", None), "master_weights_and_grads_dtype", torch.float32)
    if engine.bfloat16_enabled():
        return f"DeepSpeed bf16 (bfloat16 weights, {name(master)} master weights in the optimizer)"
    if engine.fp16_enabled():
        return f"DeepSpeed fp16 (float16 weights, {name(master)} master weights, loss scaling)"
    return "none"


def line(info: dict) -> str:
    where = f" over {info['world_size']} processes ({info['backend']})" if info["world_size"] > 1 else ""
    shards = f" ({info['sharded_parameters']:,} of {info['parameters']:,} parameters sharded)" if info["sharded_parameters"] else ""
    return (f"distributed: {info['strategy']}{where}; sharded: {info['sharded']}{shards}; "
            f"mixed precision: {info['mixed_precision']} ({info['weights']} weights)")


def units_of_one_dtype(trainer) -> None:
    """FSDP2 shards each unit's trainable parameters as one flat group, so they must share a dtype. In a bfloat16
    ERNIE MoE the router's weight stays float32 (transformers' `_keep_in_fp32_modules_strict`): full fine-tuning
    under FSDP2 with `mixed_precision: no` put both dtypes in each decoder layer's unit, and `fully_shard` failed
    ("FSDP expects uniform original parameter dtype"). Modules holding trainable parameters in a minority dtype get
    units of their own (added to the transformer-based wrap policy's classes). With FSDP2 mixed precision accelerate
    makes every trainable parameter float32 itself, so nothing is changed then."""
    from collections import Counter

    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if plugin is None or plugin.fsdp_version != 2 or trainer.accelerator.mixed_precision != "no":
        return
    policy = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy)
    held = [(type(m).__name__, p) for m in trainer.model.modules() for p in m.parameters(recurse=False) if p.requires_grad]
    sizes = Counter()
    for _, p in held:
        sizes[p.dtype] += p.numel()
    if len(sizes) < 2 or policy is not transformer_auto_wrap_policy:
        return
    main = sizes.most_common(1)[0][0]
    names = list(plugin.transformer_cls_names_to_wrap or getattr(trainer.model, "_no_split_modules", None) or [])
    plugin.transformer_cls_names_to_wrap = names + sorted({name for name, p in held if p.dtype != main} - set(names))


def report(trainer, log=print):
    """A callback that says, when training starts (the model prepared), how the run is distributed, and keeps it
    as `trainer.distribution` for train_results.json."""
    from transformers import TrainerCallback

    class Report(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            trainer.distribution = describe(trainer)
            log(line(trainer.distribution))

    trainer.add_callback(Report())
