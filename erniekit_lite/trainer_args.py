"""The Trainer arguments a recipe makes (the project's argument classes, arguments.py; GRPO: TRL's GRPOConfig):
read by `validate`'s plan and by training.

Knows nothing about the plan or the training loop; `train/common.py` adds what only a run decides (CPU sharding,
activation checkpointing by the memory free on the device).
"""

from __future__ import annotations

from pathlib import Path

from erniekit_lite.errors import UserError
from erniekit_lite.recipe import OWN_TRAIN_KEYS, Recipe, own_train, train_config_class

PAIR_METHODS = ("dpo", "orpo", "simpo", "rm")  # trained on preference pairs (data/pairs.py)


def training_args(recipe: Recipe, out: Path):
    """The arguments for the recipe's method (`recipe.train_config_class`), its `train:` keys over erniekit-lite's
    defaults."""
    import torch

    cuda = torch.cuda.is_available()
    settings = {
        "report_to": "none",
        "bf16": cuda and torch.cuda.is_bf16_supported(),  # TRL defaults to bf16, which fails on CPU
        "logging_steps": 10,
        "save_strategy": "steps",
        "save_total_limit": 2,
        "dataloader_pin_memory": cuda,
        # accelerate's dataloader copies each pinned batch to the GPU without making the host wait for the copy
        **({"accelerator_config": {"non_blocking": True}} if cuda else {}),
        # transformers' default reads every micro-batch's loss back to test it for NaN/inf (two host syncs each);
        # a non-finite loss makes a non-finite gradient norm, which the divergence guard stops on (checkpoints.py)
        "logging_nan_inf_filter": False,
        **{k: v for k, v in recipe.train.items() if k not in OWN_TRAIN_KEYS},  # erniekit-lite's own keys: not TRL's
        # owned by the recipe's own sections (see recipe.OWNED_TRAIN_KEYS)
        "output_dir": str(out),
        "remove_unused_columns": False,
        "prediction_loss_only": True,
    }
    if recipe.distributed.sync == "powersgd":
        # PowerSGD's all-reduces after the first are started from the communication thread as the previous one ends;
        # any other collective during backward (DDP's unused-parameter map, another bucket's) then starts in a
        # different order on each process, and gloo fails ("collective mismatch", seen within 5 steps)
        for key in ("ddp_bucket_cap_mb", "ddp_find_unused_parameters"):
            if key in recipe.train:
                raise UserError(f"train.{key}: distributed.sync powersgd runs DDP with one gradient bucket and no search "
                                "for unused parameters (train/sync.py); leave it out")
        settings["ddp_bucket_cap_mb"] = 1 << 20  # MiB: every gradient in one bucket
        settings["ddp_find_unused_parameters"] = False
    elif "ddp_find_unused_parameters" not in recipe.train:
        # Every trained parameter takes part in every step: adapters, split expert LoRA (an expert without tokens gets a
        # zero gradient), the fused expert stacks of full fine-tuning, a reward head. DDP's walk of the autograd graph
        # after each forward, and the used-parameter map it reads back, buy nothing (transformers turns it on for any
        # run without activation checkpointing)
        settings["ddp_find_unused_parameters"] = False
    if recipe.model.compile_layers and settings.get("torch_compile"):
        raise UserError("model.compile_layers: train.torch_compile compiles the whole model as well; choose one")
    for key in ("save_strategy", "eval_strategy", "logging_strategy"):
        if settings.get(key) is False:  # YAML 1.1 reads `save_strategy: no` as false
            settings[key] = "no"
    if recipe.method == "simpo":
        if settings.get("loss_type", "simpo") != "simpo":
            raise UserError(f"train.loss_type: method simpo is CPO's loss_type simpo; leave loss_type out "
                            f"(got {settings['loss_type']!r})")
        settings["loss_type"] = "simpo"
        settings.setdefault("cpo_alpha", 0.0)  # SimPO has no NLL term (CPO's loss_type simpo + cpo_alpha 0); > 0: CPO-SimPO
    if settings.get("fp16") and not cuda:
        raise UserError("train.fp16: true needs a CUDA GPU and none was found; on CPU use train.bf16=true (bf16 autocast) or train.fp16=false")
    if settings.get("bf16") and not cuda:
        settings["use_cpu"] = True  # transformers accepts bf16 without a GPU only so; accelerate then autocasts on CPU
    try:
        args = train_config_class(recipe.method)(**settings)
    except (ValueError, TypeError) as e:
        raise UserError(f"train: {str(e).strip().splitlines()[0]}") from None
    return args


ROUTER_LOSSES = ("router_z_loss_coef", "router_orthogonal_loss_coef")


def router_losses(recipe: Recipe, moe: bool) -> tuple[dict[str, float], str | None]:
    """The MoE router's z-loss and orthogonal loss coefficients the recipe sets for its method (train/router_losses.py)
    and the line `validate` and `train` print about them (None for a method that takes neither); a dense model with
    either set is a one-line error."""
    coefs = {key: own_train(recipe, key) for key in ROUTER_LOSSES if recipe.method in OWN_TRAIN_KEYS[key].methods}
    if not moe:
        for key, value in coefs.items():
            if value:
                raise UserError(f"train.{key} is for an MoE model (ERNIE-4.5-21B-A3B's expert router); {recipe.model.path} "
                                "is a dense model: remove it")
        return coefs, None
    if not coefs:
        return coefs, None
    return coefs, router_line(coefs)


def router_line(coefs: dict[str, float]) -> str:
    z, orthogonal = coefs["router_z_loss_coef"], coefs["router_orthogonal_loss_coef"]
    return ("moe: router z-loss " + (f"coefficient {z:g}, logged as z_loss" if z else "off") + ", orthogonal loss "
            + (f"coefficient {orthogonal:g}, logged as orthogonal_loss" if orthogonal else "off")
            + " (train.router_z_loss_coef, train.router_orthogonal_loss_coef)")
