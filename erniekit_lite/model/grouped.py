"""The MoE's routed experts as grouped matmuls: the one dispatch that split expert LoRA (model/expert_lora.py) and
4-bit experts (model/expert_4bit.py) compute through.

`experts_forward` mirrors transformers 5.23's `integrations/moe.py::grouped_mm_experts_forward` (the default ERNIE
4.5 experts implementation) for ERNIE's experts (gated, no bias, not expert-parallel), with each projection computed
by a caller's `project`; `grouped` mirrors that module's `_grouped_mm` (its `_can_use_grouped_mm` rules). Re-read both
when transformers moves. Where each expert's rows end is found by a search over the sorted ids, a fixed-size op:
`bincount` sizes its output from the ids' range, read back to the host (a GPU sync per MoE layer and pass).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def splittable(experts) -> bool:
    """transformers' fused experts as ERNIE 4.5 has them (gated, no bias, no post-norm, not expert-parallel)."""
    return (getattr(experts, "has_gate", False) and not getattr(experts, "has_bias", True)
            and not getattr(experts, "has_post_expert_norm", True) and not getattr(experts, "_is_expert_parallel", True)
            and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and (experts.gate_up_proj.dim() == 3 or getattr(experts, "nf4_shapes", None) is not None))


# Eager inside a compiled layer, one clean break per MoE layer (model/compile_layers.py): bitsandbytes' kernels and
# the loop fallback stay out of the graph
@torch.compiler.disable
def experts_forward(experts, hidden_states, top_k_index, top_k_weights, project, dtype: torch.dtype):
    """The routed experts' output: rows sorted by expert, `project(x, name, offsets)` for gate_up_proj and down_proj
    (x [S, in] sorted, group e ending at offsets[e] -> [S, out]), all in `dtype`."""
    tokens, k = top_k_index.shape
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    offsets = torch.searchsorted(expert_ids, torch.arange(experts.num_experts, device=expert_ids.device), right=True).to(torch.int32)
    # As transformers' path: grouped_mm runs in the expert weights' dtype whatever autocast says
    with torch.autocast(hidden_states.device.type, enabled=False):
        x = hidden_states[perm // k].to(dtype)
        x = project(x, "gate_up_proj", offsets)
        x = project(experts._apply_gate(x), "down_proj", offsets)
        x = x * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(dtype)
    restore = torch.empty_like(perm)
    restore[perm] = torch.arange(perm.numel(), device=perm.device)
    return x[restore].view(tokens, k, x.shape[-1]).sum(dim=1).to(hidden_states.dtype)  # sized: a layer may get no tokens


def grouped(x, weight, offsets):
    """x [S, in] (rows grouped by expert, group e ending at offsets[e]) @ weight[e] [in, out] for each group."""
    if can_group(x, weight):
        return F.grouped_mm(x, weight, offs=offsets)
    # transformers' fallback loops the same way (one read of the offsets); unbind, not indexing: one backward for the
    # whole stack (an adapter's gradient), none for a frozen weight, where transformers' custom op computes one
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
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
