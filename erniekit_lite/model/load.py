"""Tokenizer and model loading: dtype, attention backend, adapters. Knows nothing about training.

ERNIE 4.5 checkpoints load with transformers' native classes; the remote code some releases still reference
in `auto_map` is never run unless the recipe sets `model.trust_remote_code: true`.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from erniekit_lite.errors import UserError

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def adapter_base(path: str) -> str | None:
    """The base model of a LoRA output dir, or None when `path` is not an adapter."""
    config = Path(path) / "adapter_config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text())["base_model_name_or_path"]


def trained_in_4bit(run_dir: str) -> str | None:
    """For a QLoRA run dir (its recipe.yaml has model.load_in_4bit: true), the dtype its unquantized weights had."""
    import yaml

    recipe = Path(run_dir).expanduser() / "recipe.yaml"
    if not recipe.is_file():
        return None
    model = (yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}).get("model") or {}
    return model.get("dtype", "float32") if model.get("load_in_4bit") else None


def tokenizer_path(model_path: str) -> str:
    # An adapter dir saved by us carries the tokenizer; a bare adapter falls back to its base
    if adapter_base(model_path) and not (Path(model_path) / "tokenizer_config.json").is_file():
        return adapter_base(model_path)
    return model_path


# What a model folder holds, and which command needs what (said by the errors for a folder that lacks a part)
VOCABULARY_FILES = ("tokenizer.model", "tokenizer.json", "vocab.json", "vocab.txt")  # sentencepiece, tokenizers, BPE, WordPiece
TOKENIZER_FILES = (*VOCABULARY_FILES, "tokenizer_config.json")
MODEL_FOLDER = ("`validate` needs only config.json for its memory plan, the tokenizer (tokenizer.model, tokenizer_config.json, "
                "added_tokens.json and special_tokens_map.json as released, or a tokenizer.json) to read the data, and "
                "`train` the weights (*.safetensors) too")


def has_tokenizer(path: str) -> bool:
    """False for a local folder holding none of TOKENIZER_FILES (a config-only copy of a release); a Hub id, or a
    folder with some of them, is left to `load_tokenizer` to answer."""
    local = Path(path).expanduser()
    return not local.is_dir() or any((local / name).is_file() for name in TOKENIZER_FILES)


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


def resolve_attention(setting: str, packing: bool) -> str:
    """`auto`: flash attention's varlen kernel on CUDA when installed, else PyTorch's own varlen attention there
    (packed rows); per-sample sdpa for packed rows elsewhere."""
    if setting != "auto":
        return setting
    import torch

    from erniekit_lite.model.attention import NAME, VARLEN, varlen_kernel

    if torch.cuda.is_available():
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            if packing and varlen_kernel() is not None:
                return VARLEN
    return NAME if packing else "sdpa"


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
    from transformers import AutoModelForCausalLM

    import erniekit_lite.model.attention  # noqa: F401  registers packed_sdpa

    base = adapter_base(path)
    check_source(base or path)
    context = contextlib.nullcontext()
    if load_in_4bit:
        from erniekit_lite.model.expert_4bit import quantized_as_loaded
        from erniekit_lite.model.grouped import splittable

        # bitsandbytes leaves the fused routed experts (3-D parameters) in model.dtype: NF4 too, as each is loaded
        context = quantized_as_loaded(splittable, getattr(torch, DTYPES[dtype]))
    try:
        with context:
            model = (model_class or AutoModelForCausalLM).from_pretrained(
                base or path,
                dtype=getattr(torch, DTYPES[dtype]),
                attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code,
                **({"quantization_config": four_bit_config()} if load_in_4bit else {}),
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


def four_bit_config():
    """NF4 with double quantization, the QLoRA paper's settings (as ERNIEKit's and TRL's recipes); bitsandbytes runs
    it on CUDA GPUs and on CPUs, computing in `compute_dtype()`."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError("model.load_in_4bit: bitsandbytes is not installed; pip install 'erniekit-lite[qlora]'") from None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute_dtype()
    )


QUICKSTART_MODEL = "runs/tiny-ernie"  # recipes/quickstart*.yaml's model.path, written by `erniekit-lite tiny`


HUB_CHECK_TIMEOUT = 10  # seconds for the one metadata request that looks a missing local path up on the Hub
NOT_A_REPO_ID = "not a valid Hugging Face Hub repo id (ORG/NAME)"
UNREACHABLE = "the Hugging Face Hub could not be reached to look for a repo of that name"
NO_SUCH_REPO = "the Hugging Face Hub has no such repo (a private one needs `hf auth login`)"


def missing_source(path: str, error: Exception) -> str | None:
    """One line for a model path that is neither a local directory nor a reachable Hub repo (None otherwise).

    `runs/tiny-ernie` has a Hub id's shape, so a missing local dir is tried on the Hub first; the error from there
    ("couldn't connect") alone would hide that the directory does not exist. A path that cannot be a Hub id
    (`/nonexistent/model`, `./nope`) would otherwise surface as huggingface_hub's "Repo id must be in the form ..."."""
    if Path(path).expanduser().exists():
        return None
    if not _valid_repo_id(path):
        return _no_source(path, NOT_A_REPO_ID)
    text = str(error)
    if "couldn't connect" in text or "offline" in text.lower():
        return _no_source(path, UNREACHABLE)
    if "not a valid model identifier" in text or "404" in text or "Repository Not Found" in text:
        return _no_source(path, NO_SUCH_REPO)
    return None


def check_source(path: str, named: str = "model.path") -> None:
    """Before a load: a path that is no local directory is looked up on the Hub with one metadata request, no
    retries and a short timeout, and is a one-line UserError when it cannot be a repo id, the Hub has no such repo,
    or the Hub cannot be reached. Without this check `from_pretrained` retries an unreachable Hub five times per
    file (about 23 s each, a `Retrying in Ns` line per try) before the same answer. A repo already in the local
    Hugging Face cache, or HF_HUB_OFFLINE set, is left to `from_pretrained` (which reads the cache); so are answers
    that say nothing about the repo (a 5xx, say), for the download's own retries. `named`: what the path is called
    where the user gave it (a recipe key; "" for a command's own argument)."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    from erniekit_lite.retry import transport_error

    if Path(path).expanduser().exists():
        return
    if not _valid_repo_id(path):
        raise UserError(_no_source(path, NOT_A_REPO_ID, named))
    if constants.is_offline_mode() or any(
        isinstance(try_to_load_from_cache(path, name), str) for name in ("config.json", "tokenizer_config.json", "adapter_config.json")
    ):
        return
    try:
        HfApi().model_info(path, timeout=HUB_CHECK_TIMEOUT, expand=["sha"])
    except GatedRepoError:
        return  # it exists; from_pretrained says what access it needs
    except RepositoryNotFoundError:
        raise UserError(_no_source(path, NO_SUCH_REPO, named)) from None
    except transport_error():
        raise UserError(_no_source(path, UNREACHABLE, named)) from None
    except HfHubHTTPError:
        return


def _no_source(path: str, hub: str, named: str = "model.path") -> str:
    hint = ""
    if Path(path) == Path(QUICKSTART_MODEL):
        hint = f"; the quick start's tiny model is made by `erniekit-lite tiny {QUICKSTART_MODEL} --arch dense`"
    return f"{named + ': ' if named else ''}{path}: no such directory here, and {hub}{hint}"


def _valid_repo_id(path: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def one_line(error: Exception) -> str:
    """The whole message on one line: some of transformers' run over several lines, and the first alone stops
    mid-sentence ("Couldn't instantiate the backend tokenizer from one of: ")."""
    return " ".join(str(error).split()) or type(error).__name__
