"""ERNIE-4.5-VL (`Ernie4_5_VLMoeForConditionalGeneration`, transformers' `ernie4_5_vl_moe`): how the project loads it
and hands it images.

The model encodes images with its vision encoder and resampler (`get_image_features`) and writes the features over
the image placeholders' embeddings. Its forward would pass the packed text's attention arguments (`cu_seq_lens_q`,
...) on to the vision encoder too, which cuts its patches per image by itself; so the features are computed apart
(`encode_images`) and handed over as `mm_encoder_outputs`, and the packed arguments reach only the text layers.
"""

from __future__ import annotations

from pathlib import Path

from erniekit_lite.errors import UserError

MODEL_TYPE = "ernie4_5_vl_moe"
PROCESSOR_FILE = "preprocessor_config.json"


def is_vl(config) -> bool:
    return getattr(config, "model_type", None) == MODEL_TYPE


def model_type(path: str, trust_remote_code: bool = False) -> str | None:
    """The `model_type` of a model folder's config.json (or a Hub id's, from the Hub or its cache); None when unread
    (whoever loads the model then says what is missing, in its own words)."""
    import json

    from transformers import AutoConfig

    config = Path(path).expanduser() / "config.json"
    try:
        return (json.loads(config.read_text()) if config.is_file() else
                AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).to_dict()).get("model_type")
    except (OSError, ValueError):
        return None


def model_class(path: str, trust_remote_code: bool = False):
    """The auto class a model folder or Hub id loads with: the VL model's image-text class, else a causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if model_type(path, trust_remote_code) == MODEL_TYPE else AutoModelForCausalLM


def image_processor(path: str):
    """The released image processor's PIL form (transformers' default one needs torchvision) from the model's
    `preprocessor_config.json`."""
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import Ernie4_5_VLMoeImageProcessorPil

    folder = Path(path).expanduser()
    if folder.is_dir() and not (folder / PROCESSOR_FILE).is_file():
        raise UserError(f"{path}: no {PROCESSOR_FILE} (the image processor's settings) beside the VL model")
    try:
        return Ernie4_5_VLMoeImageProcessorPil.from_pretrained(str(path))
    except (OSError, ValueError) as error:
        raise UserError(f"{path}: could not load the image processor: {' '.join(str(error).split())}") from None


def processor_for(path: str):
    """The image processor of a VL model, a run's output dir (saved there by `train`) or, failing that, its base's."""
    from erniekit_lite.model.source import adapter_base

    base = adapter_base(path)
    if base is not None and not (Path(path).expanduser() / PROCESSOR_FILE).is_file():
        return image_processor(base)
    return image_processor(path)


def is_vl_run(path: str) -> bool:
    """Whether a model dir or a LoRA run's output dir (read through its base) holds an ERNIE-4.5-VL model."""
    from erniekit_lite.model.source import adapter_base

    folder = adapter_base(path) or path
    return Path(folder).expanduser().is_dir() and model_type(folder) == MODEL_TYPE  # local only: no Hub request here


VISION_MODULES = ("model.vision_tower.", "model.resampler_model.")  # the image side of the model, by parameter name


def freeze_vision(model) -> int:
    """Freeze the vision encoder and the resampler (`model.train_vision: false`, the default); returns the parameters
    frozen."""
    frozen = 0
    for name, param in model.named_parameters():
        if name.startswith(VISION_MODULES):
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


def encode_images(model, pixel_values, grid) -> dict:
    """`mm_encoder_outputs` for the VL model's forward: the images' features, encoded apart (module doc). `model`:
    the VL model's base (`Ernie4_5_VLMoeModel`)."""
    return {"image": model.get_image_features(pixel_values, grid, return_dict=True)}


def vision_plan(config, processor, trained: bool, dtype_bytes: int = 2) -> str:
    """`validate`'s line on the images: tokens an image takes at the processor's pixel budget, and the vision
    encoder's activations for the largest image, which the memory estimate does not hold yet. Frozen (the default),
    the encoder keeps nothing for backward: one block's working set at a time; trained (`lora.vision`, full
    fine-tuning), every block keeps about (6 x width + 2 x MLP width) values a patch (inputs of its norms, q/k/v,
    attention output, MLP input and hidden)."""
    vision = config.vision_config
    side = vision.patch_size * vision.spatial_merge_size  # pixels of one image token's side (28)
    size = getattr(processor, "size", None) or {}
    low, high = (size.get("shortest_edge") if isinstance(size, dict) else size.shortest_edge,
                 size.get("longest_edge") if isinstance(size, dict) else size.longest_edge)
    tokens_low, tokens_high = max(1, (low or side * side) // (side * side)), (high or side * side) // (side * side)
    patches = tokens_high * vision.spatial_merge_size**2
    width, hidden = vision.hidden_size, vision.intermediate_size
    if trained:
        held = vision.depth * patches * (6 * width + 2 * hidden) * dtype_bytes
        how = f"kept for backward over its {vision.depth} blocks"
    else:
        held = patches * (5 * width + hidden) * dtype_bytes
        how = "one block's working set (frozen: nothing kept for backward)"
    return (f"images: {tokens_low:,} to {tokens_high:,} tokens an image at the image processor's pixel budget "
            f"({low:,} to {high:,} pixels); the vision encoder's activations for the largest: about "
            f"{held / 2**30:.2f} GiB, {how}, not in the estimate above")
