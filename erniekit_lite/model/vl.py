"""ERNIE-4.5-VL (`Ernie4_5_VLMoeForConditionalGeneration`, transformers' `ernie4_5_vl_moe`): how the project loads it
and hands it images.

The model encodes images with its vision encoder and resampler (`get_image_features`) and writes the features over
the image placeholders' embeddings. Its forward would pass the packed text's attention arguments (`cu_seq_lens_q`,
...) on to the vision encoder too, which cuts its patches per image by itself; so the features are computed apart
(`encode_images`) and handed over as `mm_encoder_outputs`, and the packed arguments reach only the text layers.
"""

from __future__ import annotations

import functools
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
    images_present(model)
    return {"image": model.get_image_features(pixel_values, grid, return_dict=True)}


# A micro-batch without images (text-only records, or a row of them) would leave parts of the model out of the
# forward: every MoE layer's `vision_moe` (transformers runs it only when a token of the row routes to it) and the
# vision encoder and resampler. Under DDP (which does not search for unused parameters: trainer_args.py) a process
# whose micro-batch has no image then never reduces those gradients while another does ("Expected to have finished
# reduction in the prior iteration"), and under FSDP2 the encoder's blocks, units of their own, all-gather on one
# process only: each collective that follows is mismatched. So a forward without images holds them too, at no cost
# in values: each trained parameter left out enters the graph through the sum of an empty slice of it, an exact 0
# whose backward is a zero gradient (as for an expert that got no token); under FSDP2 the encoder's blocks run on one
# zero token, so every process gathers (and, trained, reduces) what one with an image does. Nothing is read back
# from the device: whether a micro-batch holds an image is the collator's (`pixel_values` among its keys).
NO_IMAGE = "erniekit_no_image"  # on the VL base model: the `_NoImage` its MoE layers' hooks read


class _NoImage:
    now = False  # the forward running now holds no image


def images_present(model) -> None:
    state = getattr(model, NO_IMAGE, None)
    if state is not None:
        state.now = False


def without_images(model, inputs: dict) -> None:
    """Before the forward of a micro-batch without images (`model`: the VL base model; `inputs`: its keywords): the
    MoE layers add their vision experts' exact 0 to their output, and the vision encoder's and resampler's goes into
    the input embeddings, where image features go (so, under FSDP2, each unit's backward comes in the same order as
    on a process whose row has images: a trained encoder makes the embeddings require a gradient there too)."""
    state = getattr(model, NO_IMAGE, None)
    if state is None:  # the first forward without images: hooks on the MoE layers, which do nothing while images come
        state = _NoImage()
        for module in model.modules():
            if hasattr(module, "vision_moe") and hasattr(module, "text_moe"):
                module.register_forward_hook(functools.partial(_vision_experts, state), prepend=True)  # before transformers' output recorder
        setattr(model, NO_IMAGE, state)
    state.now = True
    ids = inputs["input_ids"]
    zero = _vision_encoder(model, ids.device)
    if zero is not None and zero.requires_grad:
        inputs["inputs_embeds"] = model.get_input_embeddings()(ids) + zero


def empty_sum(params):
    """An exact 0 in the graph of each of `params` (the sum of an empty slice of it): backward gives each a zero
    gradient. None for none."""
    zero = None
    for p in params:
        part = (p[:0] if p.dim() else p.reshape(1)[:0]).sum()
        zero = part if zero is None else zero + part
    return zero


def _plus(a, b):
    return b if a is None else a if b is None else a + b


def _vision_experts(state, block, args, output):
    """A forward hook on each MoE layer (`Ernie4_5_VLMoeMoeBlock`): in a forward without images, its output plus the
    exact 0 of its vision experts' trained parameters. A router in an FSDP unit of its own (train/distribution.py
    `units_of_one_dtype`) runs on no token instead, gathered as on a process whose row has an image."""
    if not state.now:
        return None
    import torch
    from torch.distributed.fsdp import FSDPModule

    experts, grad = block.vision_moe, torch.is_grad_enabled()
    zero, own_unit = None, isinstance(experts.gate, FSDPModule)
    if own_unit:
        hidden = args[0]
        zero = experts.gate(hidden.reshape(-1, hidden.shape[-1])[:0])[0].sum()
    if not grad:
        return None
    zero = _plus(zero, empty_sum(p for name, p in experts.named_parameters()
                                 if p.requires_grad and not (own_unit and name.startswith("gate."))))
    hidden = output[0] if zero is None or not zero.requires_grad else output[0] + zero
    # transformers' branch without vision tokens returns the router logits as a view of the text router's (a
    # reshape), and FSDP2 warns of a view among its root's outputs (the scores keep them for the router losses)
    return (hidden, output[1].clone(), *output[2:])


def _vision_encoder(model, device):
    """The vision encoder's and resampler's part of `without_images`: their trained parameters' exact 0; when the
    encoder's blocks are FSDP units (sharded), those blocks run on one zero token (trained or not: their all-gathers
    must match the other processes')."""
    import itertools

    import torch
    from torch.distributed.fsdp import FSDPModule

    encoder, resampler = model.vision_tower, model.resampler_model
    grad = torch.is_grad_enabled()
    if not any(isinstance(b, FSDPModule) for b in encoder.blocks):
        return empty_sum(p for p in itertools.chain(encoder.parameters(), resampler.parameters()) if p.requires_grad) if grad else None
    trained = grad and any(p.requires_grad for p in encoder.parameters())
    with torch.set_grad_enabled(trained):
        hidden = encoder.patch_embed(torch.zeros(1, encoder.config.in_channels * encoder.config.patch_size**2, device=device))
        from transformers.utils.generic import is_flash_attention_requested

        # one sample of one token; on the host unless a flash kernel reads it (sdpa splits by its `tolist()`)
        cu = torch.tensor([0, 1], dtype=torch.int32, device=device if is_flash_attention_requested(encoder.config) else "cpu")
        head = encoder.config.hidden_size // encoder.config.num_heads
        rotary = (torch.ones(1, head, device=device), torch.zeros(1, head, device=device))  # position 0: no rotation
        for block in encoder.blocks:
            hidden = block(hidden, cu_seqlens=cu, max_seqlen=1, position_embeddings=rotary)
        hidden = encoder.ln(hidden)
    zero = hidden[:0].sum() if trained else None
    return _plus(zero, empty_sum(p for p in resampler.parameters() if p.requires_grad) if grad else None)


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
