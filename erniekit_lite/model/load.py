"""Tokenizer and model loading: dtype, 4-bit, adapters. Knows nothing about training; where a model comes from (a
folder or a Hub id, an adapter's base, its config) is model/source.py, which attention backend `auto` takes model/attention.py.

ERNIE 4.5 checkpoints load with transformers' native classes; the remote code some releases still reference
in `auto_map` is never run unless the recipe sets `model.trust_remote_code: true`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from erniekit_lite.errors import UserError
from erniekit_lite.model.source import (
    MODEL_FOLDER,
    VOCABULARY_FILES,
    adapter_base,
    check_source,
    has_tokenizer,
    missing_source,
    one_line,
)

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    # Without its files transformers blames a missing sentencepiece ("Couldn't instantiate the backend tokenizer")
    if not has_tokenizer(path):
        raise UserError(f"{path}: no tokenizer in this folder; {MODEL_FOLDER}")
    local = Path(path).expanduser()
    if local.is_dir() and not trust_remote_code and not any((local / name).is_file() for name in VOCABULARY_FILES):
        raise UserError(f"{path}: an incomplete tokenizer in this folder, no tokenizer.model or tokenizer.json; {MODEL_FOLDER}")
    check_source(path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(missing_source(path, e) or f"{path}: could not load the tokenizer: {one_line(e)}") from None


def load_model(
    path: str,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    trainable_adapter: bool = True,
    load_in_4bit: bool = False,
    model_class=None,
):
    """A causal LM from a Hub id, a model dir, or a LoRA output dir (base + adapter); `load_in_4bit` for QLoRA.
    `model_class`: another auto class to load with (a reward model: `model.reward.AutoRewardModel`)."""
    import torch

    import erniekit_lite.model.attention  # noqa: F401  registers packed_sdpa

    base = adapter_base(path)
    check_source(base or path)
    context = contextlib.nullcontext()
    if load_in_4bit:
        from erniekit_lite.model.expert_4bit import quantized_as_loaded
        from erniekit_lite.model.grouped import splittable

        # bitsandbytes leaves the fused routed experts (3-D parameters) in model.dtype: NF4 too, as each is loaded
        context = quantized_as_loaded(splittable, getattr(torch, DTYPES[dtype]))
    if model_class is None:
        from erniekit_lite.model.vl import model_class as auto_class

        model_class = auto_class(base or path, trust_remote_code)  # a causal LM, or ERNIE-4.5-VL's image-text class
    try:
        with context:
            model = model_class.from_pretrained(
                base or path,
                dtype=getattr(torch, DTYPES[dtype]),
                attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code,
                **({"quantization_config": four_bit_config(four_bit_skip(model_class))} if load_in_4bit else {}),
            )
    except (OSError, ValueError) as e:
        raise UserError(missing_source(base or path, e) or f"{base or path}: could not load the model: {one_line(e)}") from None
    if load_in_4bit:
        keep_cpu_layout(model)
        from erniekit_lite.model.expert_4bit import quantize_experts

        # their 4-bit forward (and NF4 for any that loading did not quantize)
        quantize_experts(model, getattr(torch, DTYPES[dtype]))
    freeze_router_statistics(model)
    if base:
        from erniekit_lite.model.lora import load_adapter

        model = load_adapter(model, path, trainable_adapter)
    # Packed rows are exact only without a KV cache (transformers builds no block mask when a cache exists)
    model.config.use_cache = False
    return model


def freeze_router_statistics(model) -> None:
    """ERNIE MoE's `moe_statics.e_score_correction_bias` is a statistic (added to the routing probabilities before
    top-k), defined with `requires_grad=False`; transformers 5.23's `from_pretrained` hands it back trainable. No
    gradient reaches it, so training never changed it; as a trainable float32 parameter in a bfloat16 model it broke
    FSDP2 (one dtype per unit) and left the optimizer without its state (sharded resume). Frozen again here."""
    for name, param in model.named_parameters():
        if name.endswith("moe_statics.e_score_correction_bias"):
            param.requires_grad_(False)


def compute_dtype():
    """bf16 wherever torch computes in it (CUDA GPUs from Ampere on, and CPUs), else fp32 (older GPUs)."""
    import torch

    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return torch.float32
    return torch.bfloat16


def keep_cpu_layout(model) -> None:
    """bitsandbytes 0.50 on a CPU with AVX512-BF16 repacks a 4-bit weight for its inference kernel at the first
    forward in eval mode without gradients (an eval pass, a sample generation). The repacked weight has no autograd
    (training through it afterwards gives no input gradient, silently) and is read wrongly by `dequantize_4bit`
    (transformers' `dequantize()`, peft's merge). Every Linear4bit keeps the layout it was quantized in instead."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def four_bit_skip(model_class) -> tuple[str, ...]:
    """What QLoRA leaves unquantized besides what transformers does (the LM head): ERNIE-4.5-VL's vision encoder and
    resampler (0.6B of the 28B; their LayerNorms meet 4-bit Linear outputs in another dtype on CPU)."""
    from transformers import AutoModelForImageTextToText

    return ("model.vision_tower", "model.resampler_model", "lm_head") if model_class is AutoModelForImageTextToText else ()


def four_bit_config(skip: tuple[str, ...] = ()):
    """NF4 with double quantization, the QLoRA paper's settings (as ERNIEKit's and TRL's recipes); bitsandbytes runs
    it on CUDA GPUs and on CPUs, computing in `compute_dtype()`. `skip`: modules left in the model's dtype."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError("model.load_in_4bit: bitsandbytes is not installed; pip install 'erniekit-lite[qlora]'") from None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute_dtype(),
        **({"llm_int8_skip_modules": list(skip)} if skip else {}),
    )


