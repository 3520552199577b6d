"""LoRA on the MoE's fused routed experts computed expert by expert, never merged (`lora.expert_compute: split`).

peft 0.21.2 adapts a fused 3-D expert weight (`target_parameters`) through a `ParamWrapper` whose forward registers
a parametrization W' = W + s·B@A over the whole stack (`_LoraFactorsProxy`, one baddbmm) and runs the experts on W'.
On the 21B-A3B each token uses 6 of the 64 experts, yet every MoE layer forms (and autograd keeps) a full copy of its
expert weights in every forward, and backward computes the full gradient of W' only to project it onto A and B.

Split computes, for the tokens routed to expert e, x·W_eᵀ + s·(x·A_eᵀ)·B_eᵀ, grouped over the experts (torch's
grouped_mm through model/grouped.py, as transformers' default `grouped_mm` experts implementation). W is frozen and
is only ever a matmul operand, so autograd computes no gradient for it. The outermost ParamWrapper of each experts
module (peft nests one per adapted parameter) gets this forward by a class swap to `SplitExperts`, a ParamWrapper
subclass: parameters, names, shapes, rank/alpha patterns and rsLoRA scales stay peft's, so saving, loading, merging
and export are unchanged. Disabled adapters (DPO's reference), merged ones, or
more than one active adapter take peft's own forward.

peft's layout (`ParamWrapper.get_delta_factors`), for ERNIE 4.5's experts stored [experts, out, in]
(gate_up_proj [E, 2m, h], down_proj [E, h, m]): lora_A.weight [E·r, in] holds A_e [r, in] in rows e·r .. e·r + r-1;
lora_B.weight [out, r·E] holds B_e [out, r] in columns j·E + e (rank-major, expert-minor). grouped_mm needs each
expert's B with a unit stride: `LaidOut` copies it so once per optimizer step, not in every forward (and casts A the
same way when the adapters' dtype is not the experts').
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import ParamWrapper

from erniekit_lite.errors import UserError
from erniekit_lite.model import expert_4bit
from erniekit_lite.model.grouped import experts_forward, grouped, splittable

SPLIT, MERGED = "split", "merged"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what peft folds without upcasting (fp8 experts stay peft's)


class SplitExperts(ParamWrapper):
    """The outermost ParamWrapper of a routed-experts module, computing its adapters per expert (module docstring)."""

    def forward(self, hidden_states, *args, **kwargs):
        chain, experts = wrappers(self)
        factors = {name: lora_factors(w) for name, w in chain.items()}
        dtype = compute_dtype(experts)
        peft_path = any(f is False for f in factors.values()) or dtype not in DTYPES
        if expert_4bit.is_4bit(experts) and any(f is False for f in factors.values()) and not self.disable_adapters:
            raise ValueError("4-bit routed experts: peft cannot merge an adapter into them (or run several at once)")
        if peft_path or len(args) != 2 or kwargs:  # not the MoE block's call (experts(x, top_k_index, top_k_weights))
            return super().forward(hidden_states, *args, **kwargs)
        top_k_index, top_k_weights = args
        project = lambda x, name, offsets: project_with(x, experts, name, factors.get(name), offsets)  # noqa: E731
        return experts_forward(experts, hidden_states, top_k_index, top_k_weights, project, dtype)


def wrappers(outer) -> tuple[dict, torch.nn.Module]:
    """The nested ParamWrappers of one experts module by parameter name, and the experts module itself."""
    chain, module = {}, outer
    while isinstance(module, ParamWrapper):
        chain[module.parameter_name] = module
        module = module.base_layer
    return chain, module


def lora_factors(wrapper):
    """(wrapper, adapter name) of the one active adapter; None without one; False when peft's own forward must run
    (adapters disabled or merged, or several active)."""
    if wrapper.disable_adapters or wrapper.merged:
        return False
    active = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    if len(active) != 1:
        return None if not active else False
    return wrapper, active[0]


def compute_dtype(experts) -> torch.dtype:
    """What the experts' matmuls run in: their weights' dtype, or what 4-bit ones dequantize to."""
    return experts.nf4_dtype if expert_4bit.is_4bit(experts) else experts.gate_up_proj.dtype


def set_expert_compute(model, mode: str = SPLIT) -> int:
    """Make every routed-experts module of `model` (a PeftModel) compute its adapters `split` or `merged` (peft's
    own path); returns how many modules were set. Call after the adapters exist (get_peft_model, from_pretrained)."""
    count = 0
    if mode == MERGED and any(expert_4bit.is_4bit(m) for m in model.modules()):
        raise UserError("lora.expert_compute: merged needs the routed experts unquantized, and model.load_in_4bit stores "
                        "them in 4-bit; use lora.expert_compute: split")
    for parent in model.modules():
        if isinstance(parent, ParamWrapper):
            continue  # only the outermost wrapper is called by the MoE block
        for child in parent.children():
            if isinstance(child, ParamWrapper) and splittable(wrappers(child)[1]):
                child.__class__ = SplitExperts if mode == SPLIT else ParamWrapper
                count += 1
    return count


def project_with(x, experts, name: str, lora, offsets):
    """x [S, in] sorted by expert -> [S, out]: the frozen weight `experts.<name>`'s product plus the adapter's, per
    expert. A 4-bit weight is dequantized as it runs (`expert_4bit.matmul`)."""
    if expert_4bit.is_4bit(experts):
        out = expert_4bit.matmul(x, experts, name, offsets)
    else:
        weight = getattr(experts, name)
        out = grouped(x, weight if experts.is_transposed else weight.transpose(-2, -1), offsets)
    if lora is None:
        return out
    wrapper, adapter = lora
    a, b = operands(wrapper, adapter, x.dtype)
    return torch.add(out, grouped(grouped(x, a, offsets), b, offsets), alpha=wrapper.scaling[adapter])


def operands(wrapper, adapter: str, dtype: torch.dtype):
    """(A [E, in, r'], B [E, r', out]) of `adapter` as grouped_mm takes them, in `dtype` (peft's fold casts the same
    way), r' the rank padded with zero rows to 16-byte rows: grouped_mm runs at any rank, and zero rows add nothing."""
    experts = wrapper.num_experts
    weight_a, weight_b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
    rank, inner, out = weight_a.shape[0] // experts, weight_a.shape[1], weight_b.shape[0]
    pad = -rank % (16 // torch.empty(0, dtype=dtype).element_size())
    cache = wrapper.__dict__.setdefault("laid_out", {})
    if pad or weight_a.dtype != dtype:
        a = LaidOut.apply(weight_a, cache, (adapter, "A", dtype),
                          lambda w: F.pad(w.view(experts, rank, inner).to(dtype), (0, 0, 0, pad)),
                          lambda g: g[:, :rank].reshape(experts * rank, inner).to(weight_a.dtype))
    else:
        a = weight_a.view(experts, rank, inner)  # already grouped_mm's layout: no copy
    b = LaidOut.apply(weight_b, cache, (adapter, "B", dtype),
                      lambda w: F.pad(w.view(out, rank, experts).permute(2, 1, 0).to(dtype), (0, 0, 0, pad)).contiguous(),
                      lambda g: g[:, :rank].permute(2, 1, 0).reshape(out, rank * experts).to(weight_b.dtype))
    return a.transpose(-2, -1), b


def layout_holders(model) -> list:
    """The modules of `model` whose expert adapters `LaidOut` may keep layouts for (found once, not per step)."""
    return [module for module in model.modules() if isinstance(module, ParamWrapper)]


def forget_layouts(holders: list) -> None:
    """Drop the layouts kept by `holders` (`layout_holders`): after an optimizer step they are stale, and the version
    counter alone does not tell (torch's fused AdamW updates the parameters without moving it). The project's Trainer
    calls this after every optimizer step (`step.ErnieTrainer`); a training loop of one's own calls it after its
    `optimizer.step()`."""
    for module in holders:
        module.__dict__.pop("laid_out", None)


class LaidOut(torch.autograd.Function):
    """`lay(weight)`, made once per value of `weight` and kept in `cache`: new after every optimizer step (the cache
    emptied, `forget_layouts`), in-place update (a load, a manual edit: the version counter) or replaced storage. Gradient accumulation and checkpoint
    recomputes reuse the copy; backward maps the gradient back to the weight's layout (`unlay`)."""

    @staticmethod
    def forward(ctx, weight, cache, key, lay, unlay):
        ctx.unlay = unlay
        stamp = (weight.data_ptr(), weight._version)
        if key not in cache or cache[key][0] != stamp:
            cache[key] = (stamp, lay(weight))
        return cache[key][1].detach()  # a new tensor each call: the graph hangs on it, not on the kept copy

    @staticmethod
    def backward(ctx, grad):
        return ctx.unlay(grad), None, None, None, None
