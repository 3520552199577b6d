"""What SFT and DPO runs share: the run's Trainer arguments, the model to train, the LM-head and MoE set-up."""

from __future__ import annotations

from pathlib import Path

from erniekit_lite.errors import UserError
from erniekit_lite.model.load import load_model, resolve_attention
from erniekit_lite.model.lora import groups_line, is_moe, unwrap
from erniekit_lite.plan import choose_checkpointing, gpu_free, head_keep_positions, host_available
from erniekit_lite.recipe import Recipe
from erniekit_lite.trainer_args import router_losses, training_args


def run_arguments(recipe: Recipe, out: Path, log=print):
    """The recipe's Trainer arguments for this run: sharding kept on a multi-process CPU run, on a GPU activation
    checkpointing chosen by what the plan needs against the memory free now, and train.offload resolved and checked
    against the host's memory (train/offload.py)."""
    import torch

    from erniekit_lite.train import distribution, offload

    if distribution.enabled():
        distribution.sharding_on_cpu()  # before the arguments make accelerate's state
    args = training_args(recipe, out)
    if torch.cuda.is_available():
        choose_checkpointing(recipe, args, free_memory(), log)
    offload.resolve(recipe, args, free_memory(), log)  # with checkpointing decided: it comes before any offload
    return args


def free_memory() -> int:
    """Bytes free on the device this process trains on, read now: on a GPU what is not taken (by this process or
    any other sharing the card), not its total; on CPU the memory available to new allocations."""
    import torch

    return gpu_free() if torch.cuda.is_available() else host_available()


def load_for_training(recipe: Recipe, log=print, apply_lora: bool = True):
    """The model to train; with `apply_lora=False` the caller hands the LoRA config to the trainer instead."""
    from transformers import TrainingArguments, set_seed

    # New adapters start from random weights: seeded here, they follow train.seed (the Trainer seeds only later)
    set_seed(recipe.train.get("seed", TrainingArguments.seed))
    attn = resolve_attention(recipe.model.attn_implementation, recipe.data.packing)
    load = load_model
    if recipe.method == "rm":  # the base's body under a new one-output `score` head
        from erniekit_lite.model.reward import load_model as load
    model = load(recipe.model.path, recipe.model.dtype, attn, recipe.model.trust_remote_code, load_in_4bit=recipe.model.load_in_4bit)
    if recipe.method != "rm":  # a causal LM: its forward scores our batches (train/scored.py), before TRL wraps it
        from erniekit_lite.train import scored

        scored.take(unwrap(model))
    if recipe.lora is not None and hasattr(model, "peft_config"):
        raise UserError("lora: model.path is already a LoRA output dir; omit lora: to keep training that adapter")
    if recipe.lora is not None and apply_lora:
        from erniekit_lite.model.lora import apply_lora as add_adapters

        model = add_adapters(model, recipe.lora)
    if recipe.lora is None or apply_lora:
        log(describe_model(model))
    return model


def plan_lm_head(trainer, recipe: Recipe, log=print) -> None:
    """A trained LM head (full fine-tuning): keep or recompute its chunks, as the memory plan allows (scoring.py).
    A frozen head (LoRA) needs no choice: its gradient is taken in forward."""
    from erniekit_lite.train.scoring import head_trains

    model = unwrap(trainer.model)
    head = model.get_output_embeddings()
    if head is None or not head_trains(head):
        return

    model._erniekit_head_keep_positions = head_keep_positions(recipe, trainer.args, free_memory(), log)


def watch_moe(trainer, recipe: Recipe, log=print):
    """MoE runs: say how the router is trained and start recording expert load (None for dense models)."""
    moe = is_moe(trainer.model)
    coefs, line = router_losses(recipe, moe)
    if not moe:
        return None
    aux = f"coefficient {trainer.router_aux_loss_coef:g}, logged as aux_loss" if trainer.aux_loss_enabled else "off"
    router = "trained" if any(p.requires_grad for n, p in trainer.model.named_parameters() if ".mlp.gate." in n) else "frozen"
    log(f"moe: router {router}, router aux loss {aux} (train.router_aux_loss_coef; 0 turns it off)")
    if line:
        trainer.router.z_coef, trainer.router.orthogonal_coef = coefs["router_z_loss_coef"], coefs["router_orthogonal_loss_coef"]
        log(line)
    if not recipe.output.expert_load:
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


def trainer_inputs(data, tokenizer, recipe: Recipe, packed, padded, rows=rows_dataset) -> dict:
    """The Trainer keywords every method passes alike: its rows as datasets (train, and eval when there is one), and
    its `packed` collator class (built with the row length) or `padded` one (built with the pad id)."""
    collator = packed(recipe.data.max_length) if recipe.data.packing else padded(tokenizer.pad_token_id)
    return {"train_dataset": rows(data.train.rows), "eval_dataset": rows(data.eval.rows) if data.eval is not None else None,
            "processing_class": tokenizer, "data_collator": collator}


def trl_trainer(trainer_class, model, recipe: Recipe, **kwargs):
    """A TRL trainer (built with `kwargs`) that adds the recipe's adapter itself (given a peft config, its reference is
    then the base with the adapter disabled: no copy), with the adapters checked and LoRA+'s settings attached."""
    from erniekit_lite.model.lora import SETTINGS, check_adapters, expert_compute, lora_config, targets_as_written

    config = lora_config(model, recipe.lora) if recipe.lora is not None else None
    with targets_as_written():  # TRL calls get_peft_model itself
        trainer = trainer_class(model=model, peft_config=config, **kwargs)
    if config is not None:
        check_adapters(trainer.model, config)
        expert_compute(trainer.model, recipe.lora.expert_compute)
        setattr(trainer.model, SETTINGS, recipe.lora)  # LoRA+ (train/optimizer.py) reads it
    return trainer
