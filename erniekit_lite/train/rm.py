"""Reward models (`method: rm`): the project's Trainer (train/trainer.py) with the pairwise reward loss.

The loss is TRL 1.16's RewardTrainer's, ported (`RewardLoss`; TRL itself is only the tests' oracle): per pair
−log σ(r_chosen − r_rejected [− margin, when the batch has one]), plus `center_rewards_coefficient` × (r_chosen +
r_rejected)² when set, so that the step's mean over its pairs is TRL's loss of one micro-batch. Its metrics keep TRL's
names: `accuracy` (r_chosen > r_rejected) and `margin` (r_chosen − r_rejected) over the pairs, `mean_reward` over
both sides, `min_reward` and `max_reward` over the logging window, all kept on the device until a logging step.
The model class's forward (model/reward.py) scores the pair rows of data/pairs.py, packed (one forward over the row,
per-sample attention, the reward at each sequence's last token) or padded, as `logits` [2B, 1]: chosen rows, then
rejected. The rows are tokenized and packed as for DPO (the same formats and template).

The model is model/reward.py's sequence-classification class: the base checkpoint's body and a new `score` head.
LoRA adapters are made as for SFT (model/lora.py, the MoE's fused experts included) with the head trained in full
(peft `modules_to_save`); full fine-tuning trains everything. No router aux loss is added on an MoE (TRL's
RewardTrainer added none, nor does transformers' sequence-classification forward).
"""

from __future__ import annotations

from pathlib import Path

import torch

from erniekit_lite.data.pairs import PackedPairCollator, PaddedPairCollator
from erniekit_lite.data.prepare import describe_pairs, prepare_pairs
from erniekit_lite.errors import UserError
from erniekit_lite.model.lora import unwrap
from erniekit_lite.model.reward import HEAD, check_start, is_reward_run
from erniekit_lite.recipe import Recipe
from erniekit_lite.run_plan import RunPlan
from erniekit_lite.train import run as runner
from erniekit_lite.train.common import trainer_inputs
from erniekit_lite.train.trainer import Loss, Parts, RouterAux, Trainer, ready


def run(recipe: Recipe, log=print) -> Path:
    check_start(recipe.model.path)  # before anything loads or the run dir is claimed
    kept = is_reward_run(recipe.model.path)
    log(f"reward head: {HEAD} (hidden_size -> 1, no bias) " + ("kept from model.path" if kept else
        "new, initialised as transformers initialises a new Linear: normal(0, config.initializer_range), seeded by train.seed"))
    return runner.run(recipe, METHOD, log)


class RewardLoss(Loss):
    """The unit is a pair: a micro-batch of [2B, L] rows (chosen, then rejected) holds B."""

    aux = RouterAux(False, 0.0)  # no MoE router aux loss (read by train/common.watch_moe)

    def __init__(self, center_rewards_coefficient: float | None = None):
        self.center = center_rewards_coefficient

    def units(self, batch: dict) -> int:
        return batch["input_ids"].shape[0] // 2

    def __call__(self, model, batch: dict, trainer, real: int) -> Parts:
        margin = batch.pop("margin", None)
        rewards = model(**batch, use_cache=False).logits.squeeze(-1).float()  # [2B]
        chosen, rejected = torch.chunk(rewards, chunks=2)
        difference = chosen - rejected
        losses = -torch.nn.functional.logsigmoid(difference if margin is None else difference - margin)
        if self.center is not None:  # TRL: coefficient x mean over the pairs of (r_chosen + r_rejected)^2
            losses = losses + self.center * (chosen + rejected) ** 2
        pairs = chosen.shape[0]
        mode = "train" if model.training else "eval"
        trainer.metrics.add_extreme(mode, "min_reward", rewards, "min")
        trainer.metrics.add_extreme(mode, "max_reward", rewards, "max")
        metrics = {"accuracy": ((chosen > rejected).sum(), pairs), "margin": (difference.sum(), pairs),
                   "mean_reward": (rewards.sum(), 2 * pairs)}
        return Parts(total=losses, metrics=metrics)  # per pair, in row order


def build_trainer(model, tokenizer, args, data, plan: RunPlan):
    loss = RewardLoss(args.center_rewards_coefficient)
    text = model.config.get_text_config()
    ready(model, args, moe_aux=False)  # a reward model adds no MoE aux loss (nor did TRL's RewardTrainer)
    # The head's trained copy computes on the body's output, in the model's dtype, as peft made it; ready() casts every
    # trainable parameter of a quantized model to bf16 for QLoRA's adapters (as TRL did), which keep it
    base = unwrap(model)
    dtype = base.get_input_embeddings().weight.dtype
    for name, param in model.named_parameters():
        if param.requires_grad and f"{HEAD}." in name and "lora_" not in name:
            param.data = param.data.to(dtype)
    # transformers' own forward (a reload scoring a batch) finds each sequence's last token by the pad id, which TRL's
    # RewardTrainer wrote into the config (the tokenizer's pad token, else its end-of-sequence token)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    text.pad_token_id = tokenizer.pad_token_id
    trainer = Trainer(model=model, args=args, loss=loss,
                      **trainer_inputs(data, tokenizer, plan, PackedPairCollator, PaddedPairCollator))
    # the head itself, or under LoRA peft's trained copy of it (modules_to_save; the original stays frozen beside it)
    trained = sum(p.numel() for n, p in trainer.model.named_parameters() if p.requires_grad and f"{HEAD}." in n)
    if trained != getattr(unwrap(trainer.model), HEAD).in_features:
        raise UserError(f"rm: the reward head ({HEAD}) is not trained in full ({trained} trainable weights)")
    return trainer


METRICS = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")


def last_metrics(trainer) -> dict:
    """The reward metrics of the last logged training step (over its logging window), for train_results.json."""
    logged = [h for h in trainer.state.log_history if "accuracy" in h and "loss" in h]
    return {k: logged[-1][k] for k in METRICS if logged and k in logged[-1]}


METHOD = runner.Method(
    prepare=prepare_pairs, describe=describe_pairs, build_trainer=build_trainer, trained=lambda data: len(data.train.pairs),
    metrics=last_metrics, summary=lambda metrics: f"reward accuracy {metrics.get('accuracy', float('nan')):.2f}, ",
)
