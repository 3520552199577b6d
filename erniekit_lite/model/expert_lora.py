"""LoRA on the MoE's fused routed experts computed expert by expert, never merged (`lora.expert_compute: split`).

peft 0.21.2 adapts a fused 3-D expert weight (`target_parameters`) through a `ParamWrapper` whose forward registers
a parametrization W' = W + s·B@A over the whole stack (`_LoraFactorsProxy`, one baddbmm) and runs the experts on W'.
On the 21B-A3B each token uses 6 of the 64 experts, yet every MoE layer forms (and autograd keeps) a full copy of its
expert weights in every forward, and backward computes the full gradient of W' only to project it onto A and B.

Split computes, for the tokens routed to expert e, x·W_eᵀ + s·(x·A_eᵀ)·B_eᵀ, grouped over the experts (torch's
grouped_mm, as transformers' default `grouped_mm` experts implementation; a loop over the experts hit where grouped_mm
cannot run). W is frozen and is only ever a matmul operand, so autograd computes no gradient for it. The outermost
ParamWrapper of each experts module (peft nests one per adapted parameter) gets this forward by a class swap to
`SplitExperts`, a ParamWrapper subclass: parameters, names, shapes, rank/alpha patterns and rsLoRA scales stay
peft's, so saving, loading, merging and export are unchanged. Disabled adapters (DPO's reference), merged ones, or
more than one active adapter take peft's own forward.

peft's layout (`ParamWrapper.get_delta_factors`), for ERNIE 4.5's experts stored [experts, out, in]
(gate_up_proj [E, 2m, h], down_proj [E, h, m]): lora_A.weight [E·r, in] holds A_e [r, in] in rows e·r .. e·r + r-1;
lora_B.weight [out, r·E] holds B_e [out, r] in columns j·E + e (rank-major, expert-minor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import ParamWrapper

from erniekit_lite.errors import UserError
from erniekit_lite.model import expert_4bit

SPLIT, MERGED = "split", "merged"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what peft folds without upcasting (fp8 experts stay peft's)


class SplitExperts(ParamWrapper):
    """The outermost ParamWrapper of a routed-experts module, computing its adapters per expert (module docstring)."""

    def forward(self, hidden_states, *args, **kwargs):
        chain, experts = wrappers(self)
        factors = {name: lora_factors(w) for name, w in chain.items()}
        peft_path = any(f is False for f in factors.values()) or compute_dtype(experts) not in DTYPES
        if expert_4bit.is_4bit(experts) and any(f is False for f in factors.values()) and not self.disable_adapters:
            raise ValueError("4-bit routed experts: peft cannot merge an adapter into them (or run several at once)")
        if peft_path or len(args) != 2 or kwargs:  # not the MoE block's call (experts(x, top_k_index, top_k_weights))
            return super().forward(hidden_states, *args, **kwargs)
        top_k_index, top_k_weights = args
        return experts_forward(experts, hidden_states, top_k_index, top_k_weights, factors)


def wrappers(outer) -> tuple[dict, torch.nn.Module]:
    """The nested ParamWrappers of one experts module by parameter name, and the experts module itself."""
    chain, module = {}, outer
    while isinstance(module, ParamWrapper):
        chain[module.parameter_name] = module
        module = module.base_layer
    return chain, module


def lora_factors(wrapper):
    """(A [E, r, in], B [E, r, out], scale) of the one active adapter, views of peft's weights; None without one; False
    when peft's own forward must run (adapters disabled or merged, or several active)."""
    if wrapper.disable_adapters or wrapper.merged:
        return False
    active = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    if len(active) != 1:
        return None if not active else False
    name, experts = active[0], wrapper.num_experts
    weight_a, weight_b = wrapper.lora_A[name].weight, wrapper.lora_B[name].weight
    a = weight_a.view(experts, -1, weight_a.shape[-1])
    return a, weight_b.view(weight_b.shape[0], -1, experts).permute(2, 1, 0), wrapper.scaling[name]


def splittable(experts) -> bool:
    """transformers' fused experts as ERNIE 4.5 has them (gated, no bias, no post-norm, not expert-parallel)."""
    return (getattr(experts, "has_gate", False) and not getattr(experts, "has_bias", True)
            and not getattr(experts, "has_post_expert_norm", True) and not getattr(experts, "_is_expert_parallel", True)
            and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and (experts.gate_up_proj.dim() == 3 or expert_4bit.is_4bit(experts)))


def compute_dtype(experts) -> torch.dtype:
    """What the experts' matmuls run in: their weights' dtype, or what 4-bit ones dequantize to."""
    return experts.nf4_dtype if expert_4bit.is_4bit(experts) else experts.gate_up_proj.dtype


class FourBitExperts:
    """Mixed into a 4-bit experts module's class (`quantize_experts`): its own forward, taken when no expert adapter
    wraps it (routed experts not adapted, inference of the base, adapters disabled), computes as the split path."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return experts_forward(self, hidden_states, top_k_index, top_k_weights, {})


def quantize_experts(model, dtype: torch.dtype) -> int:
    """Store every routed-experts module of `model` in NF4 (`expert_4bit`) and give it the 4-bit forward; how many.
    One module at a time: only one layer's stack is ever quantized at once."""
    count = 0
    for module in list(model.modules()):
        if splittable(module) and not isinstance(module, FourBitExperts):
            expert_4bit.restore_stats(module)
            for name in expert_4bit.NAMES:
                if name not in (getattr(module, "nf4_shapes", None) or {}):  # not already quantized as loaded
                    expert_4bit.quantize(module, name, dtype)
            module.__class__ = type(f"FourBit{type(module).__name__}", (FourBitExperts, type(module)), {})
            count += 1
    return count


def unquantize_experts(model) -> None:
    """Dequantize every 4-bit experts module back to bf16/fp32 parameters and its original class (merge)."""
    for module in list(model.modules()):
        if expert_4bit.is_4bit(module):
            expert_4bit.unquantize(module)
            module.__class__ = next(c for c in type(module).__mro__[1:] if c is not FourBitExperts)


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


# Per-expert bounds counted from the routing (data-dependent sizes): a compiled layer calls this eagerly, one clean
# break per MoE layer; traced, every new routing recompiled (model/compile_layers.py)
@torch.compiler.disable
def experts_forward(experts, hidden_states, top_k_index, top_k_weights, factors):
    """transformers' grouped_mm experts forward with each projection's adapter added per expert (x·Wᵀ + s·x·Aᵀ·Bᵀ)."""
    tokens, k = top_k_index.shape
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    # where each expert's rows end, from the sorted ids: a fixed-size search, where `bincount` reads the ids' range
    # back to the host to size its output (a GPU sync per MoE layer and pass)
    offsets = torch.searchsorted(expert_ids, torch.arange(experts.num_experts, device=expert_ids.device), right=True).to(torch.int32)
    dtype = compute_dtype(experts)
    # As the merged path: grouped_mm runs in the expert weights' dtype whatever autocast says
    with torch.autocast(hidden_states.device.type, enabled=False):
        x = hidden_states[perm // k].to(dtype)
        x = project(x, experts, "gate_up_proj", factors.get("gate_up_proj"), offsets)
        x = project(experts._apply_gate(x), experts, "down_proj", factors.get("down_proj"), offsets)
        x = x * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(dtype)
    restore = torch.empty_like(perm)
    restore[perm] = torch.arange(perm.numel(), device=perm.device)
    return x[restore].view(tokens, k, x.shape[-1]).sum(dim=1).to(hidden_states.dtype)  # sized: a layer may get no tokens


def project(x, experts, name: str, lora, offsets):
    """x [S, in] sorted by expert -> [S, out]: the frozen weight `experts.<name>`'s product plus the adapter's, per
    expert. A 4-bit weight is dequantized one expert at a time (`expert_4bit.grouped_4bit`)."""
    if expert_4bit.is_4bit(experts):
        out = expert_4bit.grouped_4bit(x, experts, name, offsets)
    else:
        weight = getattr(experts, name)
        out = grouped(x, weight if experts.is_transposed else weight.transpose(-2, -1), offsets)
    if lora is None:
        return out
    a, b, scale = lora
    # As peft's fold: the factors in the weight's dtype. B's view has no unit stride, which grouped_mm needs: a copy
    # (the size of B, kept for backward). A rank whose rows are not 16-byte aligned is padded with zero rows, which
    # add nothing: grouped_mm runs instead of a loop over the experts that reads the offsets back
    a, b = a.to(x.dtype), b.to(x.dtype)
    pad = -a.shape[1] % (16 // x.element_size())
    a, b = (F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, 0, 0, pad))) if pad else (a, b.contiguous())
    return torch.add(out, grouped(grouped(x, a.transpose(-2, -1), offsets), b, offsets), alpha=scale)


def grouped(x, weight, offsets):
    """x [S, in] (rows grouped by expert, group e ending at offsets[e]) @ weight[e] [in, out] for each group."""
    if can_group(x, weight):
        return F.grouped_mm(x, weight, offs=offsets)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
    # unbind, not indexing: one backward for the whole stack (an adapter's gradient), none for a frozen weight
    parts = [rows @ w for rows, w, n in zip(x.split(counts), weight.unbind(0), counts) if n]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[-1])


def can_group(x, weight) -> bool:
    """Where torch's grouped_mm runs (as transformers decides): CPU, CUDA from Ampere on, bf16 only under
    torch.compile; its kernels need the rows of both operands (so of the output and gradients too) 16-byte aligned."""
    if not hasattr(F, "grouped_mm") or x.device.type not in ("cpu", "cuda"):
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:  # inductor lowers grouped_mm in bf16 only
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    return all(size * x.element_size() % 16 == 0 for size in weight.shape[-2:])
