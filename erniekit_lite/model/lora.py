"""Which weights get LoRA adapters, and a check of what peft actually made trainable.

On the ERNIE 4.5 MoE, peft 0.21.2 rewrites `target_modules` as if the model still had transformers 4's per-expert
`nn.Linear`s: `gate_proj`/`up_proj`/`down_proj` are moved to the fused routed-expert parameters, so the dense
layer-0 MLP and the shared experts silently get no adapter (and `gate` or `all-linear` puts one on the router).
We therefore name the fused expert parameters ourselves (`target_parameters`) and create and load adapters with
that rewrite switched off (`targets_as_written`). tests/test_moe_lora.py pins the upstream behaviour, so a peft
upgrade that changes it fails a test instead of silently training less.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter

from erniekit_lite.errors import UserError
from erniekit_lite.recipe import LoraSection

# Fused routed-expert parameter -> the per-expert projections it holds (transformers 5 layout)
EXPERT_PARAMS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
ROUTER = "gate"  # the MoE router module (`mlp.gate`): never adapted, frozen under LoRA
GROUPS = ("attention", "dense MLP", "shared experts", "routed experts", "other")


def is_moe(model) -> bool:
    return getattr(model.config, "moe_num_experts", 0) > 0


def lora_config(model, lora: LoraSection):
    from peft import LoraConfig

    if ROUTER in lora.targets and is_moe(model):
        raise UserError("lora.targets: 'gate' is the MoE router; it stays frozen and gets no adapter (remove it)")
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    unknown = [t for t in lora.targets if t not in names]
    if unknown:
        raise UserError(f"lora.targets: no module named {unknown} in this model; it has {sorted(_linear_names(model))}")
    parameters, rank, alpha = [], {}, {}
    if is_moe(model) and lora.routed_experts:
        if lora.dropout:
            raise UserError(f"lora.dropout: peft's adapters on the fused routed experts need 0 (got {lora.dropout}); "
                            "set lora.dropout=0 or lora.routed_experts=false")
        for fused, parts in EXPERT_PARAMS.items():
            present = [p for p in parts if p in lora.targets]
            if present and len(present) < len(parts):
                raise UserError(f"lora.targets: the routed experts fuse {' and '.join(parts)} into one weight; target both or neither")
            if present:
                parameters.append(f"mlp.experts.{fused}")
            if len(present) > 1:
                # Rank r per fused projection, as transformers 4's separate gate_proj/up_proj had (peft's own convention)
                rank[rf".*\.{fused}"] = lora.r * len(parts)
                alpha[rf".*\.{fused}"] = lora.alpha * len(parts)
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.targets),
        target_parameters=parameters or None,
        rank_pattern=rank,
        alpha_pattern=alpha,
        task_type="CAUSAL_LM",
    )


@contextlib.contextmanager
def targets_as_written():
    """Create or load adapters with peft's transformers-4 target rewrite switched off (see the module docstring)."""
    from unittest import mock

    import peft.utils.transformers_weight_conversion as conversion

    with mock.patch.object(conversion, "convert_peft_config_for_transformers", lambda *args, **kwargs: None), warnings.catch_warnings():
        # peft matches rank_pattern against module names only and warns, but applies it to target_parameters too
        warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match")
        yield


def apply_lora(model, lora: LoraSection):
    """The model with new adapters, in the dtypes TRL gives them when it builds the PeftModel itself (as it does for
    DPO here; `adapter_dtypes`)."""
    from peft import get_peft_model

    config = lora_config(model, lora)
    with targets_as_written():
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=not zero3_unquantized(model))
    adapter_dtypes(peft_model)
    check_adapters(peft_model, config)
    return peft_model


def quantized(model) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def zero3_unquantized(model) -> bool:
    """DeepSpeed ZeRO-3 on an unquantized base: adapters must keep the base's dtype. peft upcasts them to fp32 by
    default (`autocast_adapter_dtype`), and ZeRO-3 gathers parameters into buffers of the first one's dtype, so
    fp32 adapters on a bf16 base fail at the first optimizer step (TRL turns the upcast off there, trl#6089)."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled() and not quantized(model)


def adapter_dtypes(peft_model, every: bool = False) -> None:
    """QLoRA: trainable adapter weights in bf16 (the QLoRA paper's setting, as TRL casts them; peft cannot skip its
    fp32 upcast for quantized bases), when the 4-bit base computes in bf16. Otherwise peft's choice stands: fp32
    adapters (bf16 under ZeRO-3, `zero3_unquantized`)."""
    import torch

    base = peft_model.get_base_model()
    compute = getattr(getattr(base, "hf_quantizer", None), "quantization_config", None)
    if quantized(base) and getattr(compute, "bnb_4bit_compute_dtype", None) == torch.bfloat16:
        for name, param in peft_model.named_parameters():
            adapter = "lora_" in name and "lora_magnitude_vector" not in name  # DoRA's magnitudes stay fp32 (trl#7268)
            if adapter and (param.requires_grad or every):  # `every`: frozen adapters loaded for inference too
                param.data = param.data.to(torch.bfloat16)


def load_adapter(model, path: str, trainable: bool = True):
    """An adapter dir saved by us (or any peft adapter) on `model`, with the same targets it was trained with."""
    from peft import PeftConfig, PeftModel

    written = PeftConfig.from_pretrained(path)
    # Adapters that name fused parameters were made for transformers 5 and must load as written;
    # older per-expert adapters still need peft's rewrite.
    context = targets_as_written() if getattr(written, "target_parameters", None) else contextlib.nullcontext()
    with context:
        peft_model = PeftModel.from_pretrained(model, path, is_trainable=trainable)
    adapter_dtypes(peft_model, every=True)  # a QLoRA adapter computes as it trained, for inference too
    return peft_model


def check_adapters(peft_model, config) -> None:
    """peft may target fewer weights than asked; verify every targeted module and expert weight got an adapter."""
    adapted = set(peft_model.base_model.targeted_module_names) | set(getattr(peft_model.base_model, "targeted_parameter_names", []))
    for target in config.target_modules:
        if not any(name.rsplit(".", 1)[-1] == target for name in adapted):
            raise UserError(f"lora.targets: peft created no adapter for {target!r}")
    moe_blocks = [n for n, m in peft_model.get_base_model().named_modules() if hasattr(m, "experts") and hasattr(m, ROUTER)]
    for fused in config.target_parameters or []:
        missing = [b for b in moe_blocks if f"{b}.{fused.removeprefix('mlp.')}" not in adapted]
        if missing:
            raise UserError(f"lora: peft left the routed experts ({fused}) of {len(missing)} layers without an adapter")
    for name, param in peft_model.named_parameters():
        if param.requires_grad and f".{ROUTER}." in name:
            raise UserError(f"lora: the router got a trainable weight ({name}); it must stay frozen")


def group_of(name: str) -> str:
    """The group a parameter belongs to, from its name (used for the trainable-parameter table)."""
    if ".self_attn." in name:
        return "attention"
    if ".shared_experts." in name:
        return "shared experts"
    if ".experts." in name:
        return "routed experts"
    if ".mlp." in name and f".mlp.{ROUTER}." not in name:
        return "dense MLP"
    return "other"


def trainable_groups(model) -> Counter:
    """Trainable parameter count per group (attention, dense MLP, shared experts, routed experts, other)."""
    groups: Counter = Counter()
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups[group_of(name)] += param.numel()
    return groups


def _linear_names(model) -> set[str]:
    import torch

    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def groups_line(model) -> str:
    groups, moe = trainable_groups(model), is_moe(model)
    # Zeros are shown for every group the architecture has, so a group left without adapters is visible
    shown = [g for g in GROUPS if groups[g] or g in ("attention", "dense MLP") or (moe and g != "other")]
    return "  trainable by group: " + ", ".join(f"{g} {groups[g]:,}" for g in shown)
