"""GRPO (`method: grpo`, TRL's GRPOTrainer) from prompts and reward functions: what it adds to the shared run (run.py).

The data are prompts (data/prompts.py) with optional reference answers; the rewards are the recipe's `rewards:`
(erniekit_lite/rewards.py: built-ins, your functions, a `method: rm` reward model), summed with their weights. The
reference (when `train.beta` > 0) is DPO's: a new adapter is handed to TRL as a config, so the reference is the base
with the adapter disabled; full fine-tuning keeps a frozen copy. PiSSA and OLoRA change the base itself: refused.
Generation is TRL's: transformers' `generate` here; for real models, vLLM in its own environment through TRL's
server mode (`trl vllm-serve`, `train.use_vllm: true`, `vllm_mode: server`), since vLLM pins another transformers.
"""

from __future__ import annotations

from pathlib import Path

from erniekit_lite.data.prompts import PreparedPrompts, describe_prompts, prepare_prompts
from erniekit_lite.recipe import Recipe
from erniekit_lite.run_plan import RunPlan
from erniekit_lite.train import run as runner


def run(recipe: Recipe, log=print) -> Path:
    return runner.run(recipe, METHOD, log)


def prompts_dataset(items):
    """Prompts as the `datasets.Dataset` TRL's sampler repeats per generation group; `answer` reaches the rewards."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [i.messages for i in items], "answer": [i.answer for i in items]})


def build_trainer(model, tokenizer, args, data: PreparedPrompts, plan: RunPlan):
    from erniekit_lite.rewards import reward_functions
    from erniekit_lite.train.grpo_trainer import ErnieGRPOTrainer

    funcs, weights = reward_functions(plan.rewards, plan.data.system)
    args.reward_weights = weights
    trainer = trl_trainer(ErnieGRPOTrainer, model, plan, reward_funcs=funcs, args=args,
                          train_dataset=prompts_dataset(data.train.items),
                          eval_dataset=prompts_dataset(data.eval.items) if data.eval is not None else None,
                          processing_class=tokenizer)
    trainer.packed_scoring = plan.data.packing
    return trainer


def metric_names(trainer) -> tuple[str, ...]:
    """TRL's GRPO metrics the run reports: mean reward, each function's mean, completion length, KL, entropy."""
    per_function = tuple(f"rewards/{name}/mean" for name in trainer.reward_func_names)
    return ("reward", "reward_std", *per_function, "completions/mean_length", "completions/clipped_ratio", "kl", "entropy",
            "frac_reward_zero_std")


def last_rewards(trainer) -> dict:
    """The reward metrics of the last logged training step, for train_results.json."""
    logged = [h for h in trainer.state.log_history if "reward" in h]
    return {k: logged[-1][k] for k in metric_names(trainer) if logged and k in logged[-1]}


def summary(metrics: dict) -> str:
    kl = f", kl {metrics['kl']:.4f}" if "kl" in metrics else ""
    return f"mean reward {metrics.get('reward', float('nan')):.3f}{kl}, "


METHOD = runner.Method(
    prepare=prepare_prompts, describe=describe_prompts, build_trainer=build_trainer,
    trained=lambda data: len(data.train.items), adapter_by_trainer=True, metrics=last_rewards, summary=summary,
)


def trl_trainer(trainer_class, model, plan: RunPlan, **kwargs):
    """TRL's GRPO trainer (built with `kwargs`), which adds the recipe's adapter itself (given a peft config, its
    reference is then the base with the adapter disabled: no copy), with the adapters checked."""
    from erniekit_lite.model.lora import check_adapters, expert_compute, lora_config, targets_as_written

    config = lora_config(model, plan.lora) if plan.lora is not None else None
    with targets_as_written():  # TRL calls get_peft_model itself
        trainer = trainer_class(model=model, peft_config=config, **kwargs)
    if config is not None:
        check_adapters(trainer.model, config)
        expert_compute(trainer.model, plan.lora.expert_compute)
    return trainer
