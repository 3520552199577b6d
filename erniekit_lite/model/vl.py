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


def model_class(path: str, trust_remote_code: bool = False):
    """The auto class a model folder or Hub id loads with: the VL model's image-text class, else a causal LM."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = Path(path).expanduser() / "config.json"
    try:
        kind = (json.loads(config.read_text()) if config.is_file() else
                AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).to_dict()).get("model_type")
    except (OSError, ValueError):
        kind = None  # from_pretrained says what is missing, in the caller's words
    return AutoModelForImageTextToText if kind == MODEL_TYPE else AutoModelForCausalLM


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
    import json

    from erniekit_lite.model.source import adapter_base

    for folder in (Path(path).expanduser(), adapter_base(path)):
        config = Path(folder).expanduser() / "config.json" if folder else None
        if config is not None and config.is_file():
            return json.loads(config.read_text()).get("model_type") == MODEL_TYPE
    return False


def encode_images(model, pixel_values, grid) -> dict:
    """`mm_encoder_outputs` for the VL model's forward: the images' features, encoded apart (module doc). `model`:
    the VL model's base (`Ernie4_5_VLMoeModel`)."""
    return {"image": model.get_image_features(pixel_values, grid, return_dict=True)}
