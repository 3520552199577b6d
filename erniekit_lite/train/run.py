"""A training run, read top to bottom: resolve the plan, check the run dir, tokenize and pack, load the model, train,
save.

SFT and preference tuning run the same steps; a `Method` (sft.py, dpo.py) names the few that differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from erniekit_lite import hub, run_plan
from erniekit_lite.model.load import load_tokenizer
from erniekit_lite.model import compile_layers, fused_lora
from erniekit_lite.model.vl import image_processor
from erniekit_lite.model.lora import initial_adapter, skip_input_casts
from erniekit_lite.recipe import Recipe
from erniekit_lite.train import callbacks, distribution, ema, offload, rundir, sequence_parallel, sync
from erniekit_lite.train.common import describe_model, free_memory, load_for_training, run_arguments, watch_moe


@dataclass(frozen=True)
class Method:
    prepare: Callable  # (DataSection, tokenizer, seed=, log=) -> the tokenized, packed data
    describe: Callable  # that data -> the lines `train` and `validate` print about it
    build_trainer: Callable  # (model, tokenizer, args, data, the run plan) -> the Trainer
    trained: Callable  # that data -> samples or pairs trained (train_results.json's train_samples)
    adapter_by_trainer: bool = False  # GRPO: TRL's trainer adds a new adapter itself (its reference: the base without it)
    metrics: Callable = lambda trainer: {}  # what the method adds to train_results.json
    summary: Callable = lambda metrics: ""  # what it adds to the final `done:` line
    finish: Callable | None = None  # (trainer, tokenizer, the run plan, out or None, log): after the final save


def loss_line(metrics: dict, history: list[dict]) -> str:
    """The run's mean loss (the Trainer's `train_loss`), with the first and last logged losses: the mean alone read as
    if nothing was learned (the quick start's 1.16 mean ends at 0.02)."""
    logged = [(h["step"], h["loss"]) for h in history if "loss" in h]
    span = (f"; logged {logged[0][1]:.4f} at step {logged[0][0]}, {logged[-1][1]:.4f} at step {logged[-1][0]}"
            if len(logged) > 1 else "")
    return f"loss {metrics['train_loss']:.4f} (mean over the run{span})"


def run(recipe: Recipe, method: Method, log=print) -> Path:
    target = rundir.target(recipe)
    rundir.check(target)  # fail before any slow step
    hub.check(recipe)
    args = run_arguments(recipe, target.out)
    # Everything decided before the first step, once (run_plan.py); from here on the plan is what the run reads
    plan = run_plan.resolve(recipe, args, free_memory(), log)
    for line in plan.lines():
        log(line)
    tokenizer = load_tokenizer(plan.tokenizer, plan.trust_remote_code)
    # launched: one process per machine tokenizes, handing off beside the run dir (data/handoff.py)
    images = {"images": image_processor(plan.tokenizer)} if plan.vl else {}  # ERNIE-4.5-VL's image processor
    data = method.prepare(plan.data, tokenizer, seed=args.seed, log=log, beside=plan.out, **images)
    log(method.describe(data))
    model = load_for_training(plan, log, apply_lora=not method.adapter_by_trainer)
    initial = initial_adapter(model)  # PiSSA/OLoRA's A and B as made, for the final save

    # Claimed only now, so a recipe or data mistake never leaves a half-made run dir behind
    claimed = rundir.claim(target, log)
    out = claimed.out
    try:  # an overwritten run waits aside until the first step (rundir): a failure before it puts it back
        trainer = method.build_trainer(model, tokenizer, args, data, plan)
        trainer.lora_plus_ratio, trainer.initial_adapter = plan.lora and plan.lora.plus_lr_ratio, initial
        trainer.add_callback(callbacks.FirstStep(claimed))
        skip_input_casts(trainer.model)  # adapters now exist, ours or the trainer's
        fused = fused_lora.describe(*fused_lora.fuse(trainer.model)) if plan.lora_forward == "fused" else None
        if fused:
            log(fused)
        if plan.compile_layers:
            compile_layers.compile_layers(trainer.model, plan.compile_backend)
            log(compile_layers.describe(plan.compile_layers, plan.compile_backend))
        distribution.units_of_one_dtype(trainer)
        distribution.report(trainer, log)
        sequence_parallel.setup(trainer, plan.sequence_parallel, log)
        expert_load = watch_moe(trainer, plan, log)
        ema.setup(trainer, plan, log)
        sync.setup(trainer, plan, log)
        offload.setup(trainer, plan.offload, log)
        if method.adapter_by_trainer and plan.lora is not None:
            log(describe_model(trainer.model))  # the adapter exists only now
        result = callbacks.train(trainer, out, args.resume_from_checkpoint)
    except BaseException:
        claimed.put_back(log)
        raise
    claimed.first_step_done()  # a run of no steps (max_steps reached) replaces it too
    metrics = {**result.metrics, **trainer.throughput(result.metrics["train_runtime"]), **method.metrics(trainer),
               "train_samples": method.trained(data), "distributed": trainer.distribution, **trainer.retry_metrics()}
    if data.eval is not None:
        metrics.update(trainer.evaluate())
    callbacks.save_final(trainer, out, metrics, expert_load)
    if images and trainer.args.should_save:  # chat and merge read a VL run's image processor from its output dir
        images["images"].save_pretrained(out)
    log(f"done: {loss_line(metrics, trainer.state.log_history)}, {method.summary(metrics)}{metrics['train_tokens_per_second']:.0f} "
        f"real tokens/s, packing efficiency {metrics['packing_efficiency']:.1%}; saved to {out}")
    if method.finish is not None:
        # Every process takes part (a sharded model's forward is collective); only the main one writes
        method.finish(trainer, tokenizer, plan, out if trainer.is_world_process_zero() else None, log)
    if trainer.is_world_process_zero():
        hub.after_training(out, recipe, log)  # loss.png and model card; the push when the recipe has hub:
    callbacks.finished(out, trainer.state)
    return out
