"""What SFT and DPO runs share: the run's Trainer arguments, the model to train, the LM-head and MoE set-up."""

from __future__ import annotations

from pathlib import Path

from erniekit_lite.errors import UserError
from erniekit_lite.model.load import load_model
from erniekit_lite.model.lora import groups_line, unwrap
from erniekit_lite.recipe import Recipe
from erniekit_lite import run_plan
from erniekit_lite.run_plan import RunPlan
from erniekit_lite.trainer_args import router_line, training_args


def run_arguments(recipe: Recipe, out: Path):
    """The recipe's Trainer arguments for this run, with sharding kept on a multi-process CPU run."""
    from erniekit_lite.train import distribution

    if distribution.enabled():
        distribution.sharding_on_cpu()  # before the arguments make accelerate's state
    return training_args(recipe, out)


def free_memory() -> int:
    """Bytes free on the device this process trains on, read now: on a GPU what is not taken (by this process or
    any other sharing the card), not its total; on CPU the memory available to new allocations."""
    import torch

    # looked up on the module at each call, not bound at import (a test's stand-in for either then reaches it)
    return run_plan.gpu_free() if torch.cuda.is_available() else run_plan.host_available()


def load_for_training(plan: RunPlan, log=print, apply_lora: bool = True):
    """The model the plan names, to train; with `apply_lora=False` the caller hands the LoRA config to the trainer."""
    from transformers import set_seed

    # New adapters start from random weights: seeded here, they follow train.seed (the Trainer seeds only later)
    set_seed(plan.seed)
    load = load_model
    if plan.method == "rm":  # the base's body under a new one-output `score` head
        from erniekit_lite.model.reward import load_model as load
    model = load(plan.source, plan.dtype, plan.attention, plan.trust_remote_code, load_in_4bit=plan.load_in_4bit)
    if plan.method != "rm":  # a causal LM: its forward scores our batches (train/scored.py), before TRL wraps it
        from erniekit_lite.train import scored

        scored.take(unwrap(model), plan.head_keep_positions)
    if plan.lora is not None and hasattr(model, "peft_config"):
        raise UserError("lora: model.path is already a LoRA output dir; omit lora: to keep training that adapter")
    if plan.vl and plan.lora is None and not plan.vision_trains:  # full fine-tuning keeps the vision encoder frozen
        from erniekit_lite.model.vl import freeze_vision

        freeze_vision(unwrap(model))
    if plan.lora is not None and apply_lora:
        from erniekit_lite.model.lora import apply_lora as add_adapters

        model = add_adapters(model, plan.lora)
    if plan.lora is None or apply_lora:
        log(describe_model(model))
    return model


def watch_moe(trainer, plan: RunPlan, log=print):
    """MoE runs: say how the router is trained and start recording expert load (None for dense models)."""
    if not plan.moe:
        return None
    from erniekit_lite.train.trainer import RouterAux

    moe_aux = trainer.loss.aux if hasattr(trainer, "loss") else RouterAux(trainer.aux_loss_enabled, trainer.router_aux_loss_coef)  # GRPO: TRL's
    aux = f"coefficient {moe_aux.coef:g}, logged as aux_loss" if moe_aux.enabled else "off"
    router = "trained" if any(p.requires_grad for n, p in trainer.model.named_parameters()
                              if ".mlp.gate." in n or "_moe.gate." in n) else "frozen"  # ERNIE-4.5-VL: text_moe/vision_moe
    log(f"moe: router {router}, router aux loss {aux} (train.router_aux_loss_coef; 0 turns it off)")
    if plan.router:
        router = trainer.loss.router
        router.z_coef, router.orthogonal_coef = plan.router["router_z_loss_coef"], plan.router["router_orthogonal_loss_coef"]
        log(router_line(plan.router))
    if not plan.expert_load:
        return None
    from erniekit_lite.train.expert_load import save_callback, track

    load = track(trainer.model)
    trainer.add_callback(save_callback(load))
    return load


def describe_model(model) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    config = model.config
    lines = [f"model: {type(model).__name__} attention={config._attn_implementation} trainable {trainable:,} of {total:,} parameters"]
    lines.append(groups_line(model))
    if getattr(config, "output_router_logits", False):
        lines.append(f"  router aux loss coefficient {config.router_aux_loss_coef} (logged as aux_loss)")
    return "\n".join(lines)


def rows_dataset(rows):
    """Packed rows (SFT `Row` or DPO `PairRow`) as the `datasets.Dataset` the Trainer iterates."""
    from datasets import Dataset

    return Dataset.from_dict(
        {"input_ids": [r.input_ids for r in rows], "labels": [r.labels for r in rows], "seq_lengths": [r.seq_lengths for r in rows]}
    )


def trainer_inputs(data, tokenizer, plan: RunPlan, packed, padded, rows=rows_dataset) -> dict:
    """The Trainer keywords every method passes alike: its rows as datasets (train, and eval when there is one), and
    its `packed` collator class (built with the row length) or `padded` one (built with the pad id)."""
    collator = packed(plan.data.max_length) if plan.data.packing else padded(tokenizer.pad_token_id)
    return {"train_dataset": rows(data.train.rows), "eval_dataset": rows(data.eval.rows) if data.eval is not None else None,
            "processing_class": tokenizer, "data_collator": collator}


def vl_trainer_inputs(data, tokenizer, plan: RunPlan, collator) -> dict:
    """`trainer_inputs` for ERNIE-4.5-VL rows (data/vl_rows.py): the datasets are row indices, and the `collator` class,
    which always lays samples end to end, holds the rows (train, then eval)."""
    from erniekit_lite.data.vl_rows import index_dataset

    held = data.eval.rows if data.eval is not None else []
    return {"train_dataset": index_dataset(0, len(data.train.rows)),
            "eval_dataset": index_dataset(len(data.train.rows), len(held)) if data.eval is not None else None,
            "processing_class": tokenizer, "data_collator": collator(plan.data.max_length, data.train.rows + held)}
