"""LoRA's Linear as one autograd step: y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ with a hand-written backward (issue 45).

peft's Linear runs its base layer, then `lora_A`, `lora_B`, the scale and the add as separate modules, each with its
own autograd nodes: about 20 kernels per adapted Linear and step where the base alone needs 2, so a LoRA step
launched more work than full fine-tuning although it skips every weight gradient. Here the forward is the base
matmul, one `x·Aᵀ` (scaled in the same call) and one add of `·Bᵀ` into the base output; the backward computes what
the frozen base needs (the input's gradient) and the two adapter gradients, nothing else. The idea of unsloth's LoRA
kernels, in plain torch so it runs wherever the model does.

Only the forward changes: the adapters stay peft's modules and parameters, so saving, loading, merging, export,
serving and old adapters are untouched. A layer takes this path when its adapter is vanilla LoRA (rsLoRA, rank and
alpha patterns, PiSSA/OLoRA's initialisation and LoRA+ are: they change values or the optimizer, not the forward)
without dropout or a bias of its own (peft's `lora_bias`), its base is a plain `nn.Linear` (not bitsandbytes' 4-bit:
QLoRA) whose weight and bias are frozen (not peft's `bias: all` / `lora_only`), and its weights are not sharded by
ZeRO-3: an adapter folder made elsewhere and trained on here may have any of these. Per call it falls back to peft's forward with the adapter disabled or merged, several adapters active,
or outside autocast with adapters in another dtype than the base (peft then computes them in theirs).
"""

from __future__ import annotations

import functools

import torch

from erniekit_lite.classes import same_named


class LoraLinear(torch.autograd.Function):
    """y = x·Wᵀ (+ bias) + s·(x·Aᵀ)·Bᵀ in `dtype`; W (and the bias) frozen. Saves x and s·x·Aᵀ (tokens × rank)."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float, dtype: torch.dtype):
        shape = x.shape
        with torch.autocast(x.device.type, enabled=False):  # the dtypes are set here, as autocast would set them
            x2 = x.reshape(-1, shape[-1]).to(dtype)
            w, a, b = weight.to(dtype), lora_a.to(dtype), lora_b.to(dtype)
            y = torch.mm(x2, w.t()) if bias is None else torch.addmm(bias.to(dtype), x2, w.t())
            xa = torch.empty((x2.shape[0], a.shape[0]), dtype=dtype, device=x.device).addmm_(x2, a.t(), beta=0, alpha=scaling)
            y.addmm_(xa, b.t())
        ctx.save_for_backward(x2, w, a, b, xa)
        ctx.scaling, ctx.shape, ctx.dtypes = scaling, shape, (x.dtype, lora_a.dtype, lora_b.dtype)
        return y.view(*shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x2, w, a, b, xa = ctx.saved_tensors
        x_dtype, a_dtype, b_dtype = ctx.dtypes
        g = grad.reshape(-1, w.shape[0]).to(w.dtype)
        # gradient of s·(x·Aᵀ): the output's gradient through B, scaled once for both uses below
        ga = torch.empty((g.shape[0], a.shape[0]), dtype=g.dtype, device=g.device).addmm_(g, b, beta=0, alpha=ctx.scaling)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.mm(g, w).addmm_(ga, a).view(ctx.shape).to(x_dtype)
        da = torch.mm(ga.t(), x2).to(a_dtype) if ctx.needs_input_grad[3] else None
        db = torch.mm(g.t(), xa).to(b_dtype) if ctx.needs_input_grad[4] else None
        return dx, None, None, da, db, None, None


def _eligible(module) -> str | None:
    """Why this peft LoRA Linear keeps peft's forward, or None."""
    if type(module.get_base_layer()) is not torch.nn.Linear:
        return "4-bit or 8-bit base (QLoRA)"
    if module.lora_variant:
        return "DoRA"
    if any(not isinstance(d, torch.nn.Identity) for d in module.lora_dropout.values()):
        return "dropout"
    if any(hasattr(p, "ds_id") for p in module.parameters()):
        return "ZeRO-3 sharding"
    # the fused function computes x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ with W and b frozen: an adapter trained elsewhere may have
    # more (peft's lora_bias=True, or bias: all / lora_only), which it would leave out or leave untrained
    if any(getattr(b, "bias", None) is not None for b in module.lora_B.values()):
        return "a bias on lora_B (lora_bias)"
    base = module.get_base_layer()
    if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        return "a trained base weight or bias (bias: all or lora_only)"
    return None


@functools.cache
def fused_class(cls: type) -> type:
    """peft's LoRA Linear class `cls` with the fused forward (one class per peft class, named as it is); the layer
    stays peft's module, with peft's forward one `super()` away for what the fused one does not compute."""

    def forward(self, x, *args, **kwargs):
        names = self.active_adapters
        if args or kwargs or self.disable_adapters or self.merged or len(names) != 1 or names[0] not in self.lora_A:
            return cls.forward(self, x, *args, **kwargs)
        base, a, b = self.get_base_layer(), self.lora_A[names[0]].weight, self.lora_B[names[0]].weight
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        elif a.dtype == b.dtype == base.weight.dtype == x.dtype:
            dtype = x.dtype
        else:  # peft computes the adapters in their own dtype here
            return cls.forward(self, x, *args, **kwargs)
        return LoraLinear.apply(x, base.weight, base.bias, a, b, float(self.scaling[names[0]]), dtype)

    return same_named(cls, __name__, forward=forward, fused_lora=True)


def fuse(model) -> tuple[int, dict[str, int]]:
    """Give every eligible peft LoRA Linear of `model` the fused forward. Returns (layers fused, {reason: layers not}).
    Other LoRA layers are not counted: the MoE's routed experts have their own path (expert_lora.py)."""
    from peft.tuners.lora import Linear

    fused, kept = 0, {}
    for module in model.modules():
        if not isinstance(module, Linear) or getattr(module, "fused_lora", False):
            continue
        why = _eligible(module)
        if why is not None:
            kept[why] = kept.get(why, 0) + 1
            continue
        module.__class__ = fused_class(type(module))  # its class, not an attribute of the instance (train/scored.py's way)
        fused += 1
    return fused, kept


def describe(fused: int, kept: dict[str, int]) -> str | None:
    """The log line: how many adapted layers take the fused path, and why the others keep peft's."""
    if not fused and not kept:
        return None
    others = "; ".join(f"{n} kept peft's path: {why}" for why, n in kept.items())
    return f"LoRA: fused forward and backward on {fused} of {fused + sum(kept.values())} adapted layers" + (f" ({others})" if others else "")
