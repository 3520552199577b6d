"""Which modules get LoRA adapters, and a check of what peft actually made trainable."""

from __future__ import annotations

from collections import Counter

from erniekit_lite.errors import UserError
from erniekit_lite.recipe import LoraSection


def lora_config(model, lora: LoraSection):
    from peft import LoraConfig

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    unknown = [t for t in lora.targets if t not in names]
    if unknown:
        raise UserError(f"lora.targets: no module named {unknown} in this model; it has {sorted(_linear_names(model))}")
    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.targets), task_type="CAUSAL_LM")


def apply_lora(model, lora: LoraSection):
    from peft import get_peft_model

    peft_model = get_peft_model(model, lora_config(model, lora))
    check_adapters(peft_model, lora)
    return peft_model


def check_adapters(peft_model, lora: LoraSection) -> None:
    """peft may silently target fewer modules than asked (it does on the MoE); verify by trainable names."""
    adapted = trainable_groups(peft_model)
    missing = [t for t in lora.targets if not adapted.get(t)]
    if missing:
        raise UserError(f"lora.targets: peft created no adapter for {missing}")


def trainable_groups(model) -> Counter:
    """Trainable parameter count per target module name (q_proj, ...), from the parameter names."""
    groups: Counter = Counter()
    for name, param in model.named_parameters():
        if param.requires_grad and ".lora_" in name:
            module = name.split(".lora_")[0].rsplit(".", 1)[-1]
            groups[module] += param.numel()
    return groups


def _linear_names(model) -> set[str]:
    import torch

    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
