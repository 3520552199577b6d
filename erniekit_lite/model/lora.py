"""Which weights get LoRA adapters, and a check of what peft actually made trainable.

On the ERNIE 4.5 MoE, peft 0.21.2 rewrites `target_modules` as if the model still had transformers 4's per-expert
`nn.Linear`s: `gate_proj`/`up_proj`/`down_proj` are moved to the fused routed-expert parameters, so the dense
layer-0 MLP and the shared experts silently get no adapter (and `gate` or `all-linear` puts one on the router).
We therefore name the fused expert parameters ourselves (`target_parameters`) and create and load adapters with
that rewrite switched off (`targets_as_written`). tests/test_moe_lora.py pins the upstream behaviour, so a peft
upgrade that changes it fails a test instead of silently training less. How those expert adapters compute (per
expert, or peft's merged stack: `lora.expert_compute`) is model/expert_lora.py's job.

LoRA variants (rsLoRA, DoRA, peft's initialisations, LoRA+) are checked here against what peft 0.21.2 supports on
the weights they would reach (`check_variants`); PiSSA and OLoRA move part of each base weight into the adapter,
and the final save converts such an adapter back to a plain LoRA on the unchanged base (`save_as_plain_lora`).
tests/test_lora_variants.py pins the peft refusals.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import warnings
from collections import Counter

from erniekit_lite import words
from erniekit_lite.classes import same_named
from erniekit_lite.errors import UserError
from erniekit_lite.recipe import LoraSection, mutates_base
from erniekit_lite.files import follow_umask

# Fused routed-expert parameter -> the per-expert projections it holds (transformers 5 layout)
EXPERT_PARAMS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
ROUTER = "gate"  # the MoE router module (`mlp.gate`): never adapted, frozen under LoRA
GROUPS = ("attention", "dense MLP", "shared experts", "routed experts", "vision encoder", "other")
HEAD = "score"  # a reward model's head (model/reward.py): trained in full, no adapter


def unwrap(model):
    """The transformers model under peft's wrapper (the model itself when it has no adapter)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def is_moe(model) -> bool:
    return getattr(model.config.get_text_config(), "moe_num_experts", 0) > 0  # ERNIE-4.5-VL: its text model's


# ERNIE-4.5-VL's vision encoder and resampler Linears (lora.vision), as name suffixes peft matches (`mlp` alone would
# also name the text layers' dense MLP module)
VISION_TARGETS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2", "spatial_linear.fc1", "spatial_linear.fc2",
                  "temporal_linear.fc1", "temporal_linear.fc2", "resampler_model.mlp")


def expert_blocks(model) -> list[str]:
    """Where a layer's routed experts sit, below the layer: `mlp` (ERNIE 4.5 MoE), or `mlp.text_moe` and
    `mlp.vision_moe` (ERNIE-4.5-VL's modality-isolated experts)."""
    found = {re.sub(r"^.*\.layers\.\d+\.", "", name) for name, m in model.named_modules()
             if hasattr(m, "experts") and hasattr(m, ROUTER) and re.search(r"\.layers\.\d+\.", name)}
    return sorted(found)


def lora_config(model, lora: LoraSection):
    import torch
    from peft import LoraConfig

    if ROUTER in lora.targets and is_moe(model):
        raise UserError("lora.targets: 'gate' is the MoE router; it stays frozen and gets no adapter (remove it)")
    vl = getattr(model.config, "model_type", None) == "ernie4_5_vl_moe"
    if lora.vision and not vl:
        raise UserError("lora.vision: this model has no vision encoder (ERNIE-4.5-VL models do); remove it")
    targets = list(lora.targets) + [t for t in VISION_TARGETS if lora.vision and t not in lora.targets]
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    unknown = [t for t in lora.targets if t not in names]
    if unknown:
        raise UserError(f"lora.targets: no module named {unknown} in this model; it has {sorted(_linear_names(model))}")
    check_variants(model, lora)
    reward = isinstance(getattr(model, HEAD, None), torch.nn.Module)
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
                parameters += [f"{block}.experts.{fused}" for block in expert_blocks(model)]
            if present and (len(parts) > 1 or lora.expert_r):
                # Rank r per fused projection, as transformers 4's separate gate_proj/up_proj had (peft's own convention),
                # at the scale of a rank-r adapter: alpha x 2 keeps alpha / r, alpha x sqrt(2) keeps rsLoRA's alpha / sqrt(r)
                rank[rf".*\.experts\.{fused}"] = (lora.expert_r or lora.r) * len(parts)
                alpha[rf".*\.experts\.{fused}"] = lora.alpha * (math.sqrt(len(parts)) if lora.use_rslora else len(parts))
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        target_parameters=parameters or None,
        rank_pattern=rank,
        alpha_pattern=alpha,
        use_rslora=lora.use_rslora,
        use_dora=lora.use_dora,
        init_lora_weights=lora.init,
        # A reward model (model/reward.py): its new `score` head trains in full beside the adapters (and is saved with them)
        task_type="SEQ_CLS" if reward else "CAUSAL_LM",
        modules_to_save=[HEAD] if reward else None,
    )


def check_variants(model, lora: LoraSection) -> None:
    """One line for each combination peft 0.21.2 refuses (or would get wrong) on this model."""
    if is_moe(model) and lora.routed_experts:
        # peft's ParamWrapper (LoRA on the fused 3-D expert weights) raises for use_dora and any LoRA variant, and its
        # init reads `base_layer.weight`, which the experts module does not have
        if lora.use_dora:
            raise UserError("lora.use_dora: peft 0.21.2 has no DoRA for the MoE's fused routed-expert weights; set "
                            "lora.routed_experts=false (DoRA on attention, dense MLP and shared experts) or lora.use_dora=false")
        if lora.init not in (True, "gaussian"):
            raise UserError(f"lora.init: peft 0.21.2 cannot start the MoE's fused routed-expert adapters as {lora.init} "
                            "(true or gaussian only); set lora.routed_experts=false or lora.init=true")
    if quantized(model) and lora.init not in (True, "gaussian"):
        why = ("re-quantizes the residual weights, which an adapter saved for the unchanged base cannot reproduce"
               if lora.init == "olora" else "needs the base weights in float (peft refuses a 4-bit base)")
        raise UserError(f"lora.init: {lora.init} on a 4-bit base (model.load_in_4bit) {why}; use lora.init true or gaussian")
    if lora.init == "orthogonal" and lora.r % 2:
        raise UserError(f"lora.init: orthogonal needs an even lora.r (got {lora.r})")
    if lora.use_dora and lora.init == "mica":
        raise UserError("lora.use_dora: peft 0.21.2 cannot combine DoRA with lora.init mica (two LoRA variants)")


def on_meta(model) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


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
    if on_meta(model):  # `validate` counts parameters on a weightless model: inits that read the weights cannot run
        config.init_lora_weights = True
    with targets_as_written():
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=not zero3_unquantized(model))
    adapter_dtypes(peft_model)
    check_adapters(peft_model, config)
    expert_compute(peft_model, lora.expert_compute)
    return peft_model


def expert_compute(peft_model, mode: str) -> None:
    """MoE: the routed experts' adapters computed per expert (`split`, model/expert_lora.py) or by peft (`merged`)."""
    if is_moe(peft_model):
        from erniekit_lite.model.expert_lora import set_expert_compute

        set_expert_compute(peft_model, mode)


def initial_adapter(peft_model) -> dict | None:
    """PiSSA/OLoRA: the adapter's A and B before training (host copies), which the final save needs to write a plain
    LoRA on the unchanged base (`save_as_plain_lora`); None for the other inits. Taken before the first step."""
    from peft import get_peft_model_state_dict

    if not hasattr(peft_model, "peft_config") or not mutates_base(peft_model.peft_config["default"].init_lora_weights):
        return None
    initial = get_peft_model_state_dict(peft_model)
    return {k: v.detach().to("cpu", copy=True) for k, v in initial.items() if ".lora_A." in k or ".lora_B." in k}


def save_as_plain_lora(adapter_dir, initial: dict) -> bool:
    """A PiSSA/OLoRA adapter saved in `adapter_dir` rewritten as a plain LoRA on the unchanged base; False when the
    saved adapter is not one (already converted, or another init).

    What peft's `save_pretrained(path_initial_model_for_weight_conversion=...)` does, done on the saved files so that
    it also holds for gathered (FSDP, ZeRO-3) state dicts, keeps DoRA's magnitudes (peft's conversion drops every key
    but lora_A/lora_B), and scales alpha_pattern right under rsLoRA: the trained weight W_res + s B A equals
    W + s (B A - B0 A0) = W + s [B | -B0] [A ; A0], rank 2r; the config as peft writes it then: r x 2, alpha x 2
    (x sqrt(2) with rsLoRA, so the scale stays), init_lora_weights true.
    """
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    adapter_dir = Path(adapter_dir)
    config_path, weights_path = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    config = json.loads(config_path.read_text())
    if not mutates_base(config.get("init_lora_weights")):
        return False
    tensors = load_file(weights_path)
    for name, value in tensors.items():
        if ".lora_A." in name:
            tensors[name] = torch.cat([value, initial[name].to(value.dtype)], dim=0).contiguous()
        elif ".lora_B." in name:
            tensors[name] = torch.cat([value, -initial[name].to(value.dtype)], dim=1).contiguous()
    scale = math.sqrt(2) if config.get("use_rslora") else 2
    config.update(init_lora_weights=True, r=config["r"] * 2, lora_alpha=config["lora_alpha"] * scale,
                  rank_pattern={k: v * 2 for k, v in (config.get("rank_pattern") or {}).items()},
                  alpha_pattern={k: v * scale for k, v in (config.get("alpha_pattern") or {}).items()})
    save_file(tensors, weights_path, metadata={"format": "pt"})
    follow_umask(weights_path)  # safetensors writes 0600
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return True


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


def skip_input_casts(model) -> int:
    """Under autocast, adapters without dropout take their input as it comes: peft casts each adapted Linear's input
    to the fp32 adapter dtype, and autocast casts it straight back to bf16 for the matmul, two kernels per layer and
    direction for nothing (bit-identical without them, tests/test_lora_variants.py). Outside autocast, and with
    dropout (which would scale in the other dtype), peft's cast stays. Each such layer gets a subclass of its peft
    class (`uncast_class`), no attribute of the instance. Returns the layers changed."""
    import torch
    from peft.tuners.lora import LoraLayer

    changed = 0
    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if isinstance(module, LoraLayer) and dropouts and all(isinstance(d, torch.nn.Identity) for d in dropouts.values()):
            if not getattr(module, "uncast_input", False):
                module.__class__ = uncast_class(type(module))
            changed += 1
    return changed


@functools.cache
def uncast_class(cls: type) -> type:
    """peft's LoRA layer class `cls` whose `_cast_input_dtype` (peft 0.21.2, private) leaves the input as it comes under
    autocast (`skip_input_casts`); named as `cls` is."""
    import torch

    def _cast_input_dtype(self, x, dtype):
        if x is not None and torch.is_autocast_enabled(x.device.type):
            return x
        return cls._cast_input_dtype(self, x, dtype)

    return same_named(cls, __name__, _cast_input_dtype=_cast_input_dtype, uncast_input=True)


def load_adapter(model, path: str, trainable: bool = True):
    """An adapter dir saved by us (or any peft adapter) on `model`, with the same targets it was trained with."""
    from peft import PeftConfig, PeftModel

    written = PeftConfig.from_pretrained(path)
    # Adapters made for transformers 5 (ours: fused expert parameters named, or the routed experts left out) must load
    # as written; only adapters of transformers 4's per-expert layout need peft's rewrite.
    as_written = getattr(written, "target_parameters", None) or not per_expert_weights(path)
    context = targets_as_written() if as_written else contextlib.nullcontext()
    with context:
        peft_model = PeftModel.from_pretrained(model, path, is_trainable=trainable)
    adapter_dtypes(peft_model, every=True)  # a QLoRA adapter computes as it trained, for inference too
    expert_compute(peft_model, "split")  # continued training and inference alike (no recipe lora: section says otherwise)
    return peft_model


def per_expert_weights(path) -> bool:
    """Whether a saved adapter holds weights of single routed experts (`mlp.experts.N.`: transformers 4's layout).
    Unreadable (no safetensors file): assumed so, which keeps peft's own loading."""
    import re
    from pathlib import Path

    from safetensors import safe_open

    file = Path(path) / "adapter_model.safetensors"
    if not file.is_file():
        return True
    with safe_open(str(file), "pt") as f:
        return any(re.search(r"\.experts\.\d+\.", key) for key in f.keys())


def check_adapters(peft_model, config) -> None:
    """peft may target fewer weights than asked; verify every targeted module and expert weight got an adapter."""
    adapted = set(peft_model.base_model.targeted_module_names) | set(getattr(peft_model.base_model, "targeted_parameter_names", []))
    for target in config.target_modules:
        if not any(name == target or name.endswith(f".{target}") for name in adapted):
            raise UserError(f"lora.targets: peft created no adapter for {target!r}")
    moe_blocks = [n for n, m in peft_model.get_base_model().named_modules() if hasattr(m, "experts") and hasattr(m, ROUTER)]
    for fused in config.target_parameters or []:
        block, leaf = fused.split(".experts.")  # `mlp` or (VL) `mlp.text_moe`, and the fused weight
        missing = [b for b in moe_blocks if b.endswith(f".{block}") and f"{b}.experts.{leaf}" not in adapted]
        if missing:
            raise UserError(f"lora: peft left the routed experts ({fused}) of {words.count(len(missing), 'layer')} without an adapter")
    for name, param in peft_model.named_parameters():
        if param.requires_grad and f".{ROUTER}." in name:
            raise UserError(f"lora: the router got a trainable weight ({name}); it must stay frozen")


def group_of(name: str) -> str:
    """The group a parameter belongs to, from its name (used for the trainable-parameter table)."""
    if "vision_tower." in name or "resampler_model." in name:  # ERNIE-4.5-VL
        return "vision encoder"
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
    vision = getattr(model.config, "model_type", None) == "ernie4_5_vl_moe"
    shown = [g for g in GROUPS if groups[g] or g in ("attention", "dense MLP") or (moe and g not in ("other", "vision encoder"))
             or (vision and g == "vision encoder")]
    return "  trainable by group: " + ", ".join(f"{g} {groups[g]:,}" for g in shown)
