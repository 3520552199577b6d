"""Reward models (`method: rm`): TRL's RewardTrainer on packed preference pairs.

TRL keeps all of it: the loss (-log sigmoid(r_chosen - r_rejected), plus `center_rewards_coefficient` x mean(r^2)
when set), the metrics (accuracy, margin, min/mean/max reward, num_tokens) and the training loop. Its
`compute_loss` calls `model(**inputs)` and splits `outputs.logits` [2B, 1] into chosen and rejected halves; we change
only what feeds it: the model class's forward (model/reward.py) scores the pair rows of data/pairs.py,
packed (one forward over the row, per-sample attention, the reward at each sequence's last token) or padded, in that
layout. TRL's own tokenization (`_prepare_dataset`) is skipped: the rows are tokenized and packed already, exactly as
for DPO (the same formats and template).

The model is model/reward.py's sequence-classification class: the base checkpoint's body and a new `score` head.
LoRA adapters are made as for SFT (model/lora.py, the MoE's fused experts included) with the head trained in full
(peft `modules_to_save`); full fine-tuning trains everything. TRL's RewardTrainer adds no router aux loss on an MoE
(nor does transformers' sequence-classification forward): none is added here either.
"""

from __future__ import annotations

from pathlib import Path

from trl import RewardTrainer

from erniekit_lite.data.pairs import PackedPairCollator, PaddedPairCollator
from erniekit_lite.data.prepare import describe_pairs, prepare_pairs
from erniekit_lite.errors import UserError
from erniekit_lite.model.lora import unwrap
from erniekit_lite.model.reward import HEAD, check_start, is_reward_run
from erniekit_lite.recipe import Recipe
from erniekit_lite.run_plan import RunPlan
from erniekit_lite.train import run as runner
from erniekit_lite.train.common import trainer_inputs
from erniekit_lite.train.step_weights import PairTrainer


def run(recipe: Recipe, log=print) -> Path:
    check_start(recipe.model.path)  # before anything loads or the run dir is claimed
    kept = is_reward_run(recipe.model.path)
    log(f"reward head: {HEAD} (hidden_size -> 1, no bias) " + ("kept from model.path" if kept else
        "new, initialised as transformers initialises a new Linear: normal(0, config.initializer_range), seeded by train.seed"))
    return runner.run(recipe, METHOD, log)


class ErnieRewardTrainer(PairTrainer, RewardTrainer):
    aux_loss_enabled = False  # TRL's RewardTrainer adds no MoE router aux loss (read by train/common.watch_moe)
    router_aux_loss_coef = 0.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        base = unwrap(self.model)  # model/reward.py's class: its forward scores our pair batches
        # TRL casts every trainable parameter of a quantized model to bf16 (for QLoRA's adapters); the head's trained copy
        # computes on the body's output, in the model's dtype, as peft made it (the adapters keep TRL's and our bf16)
        dtype = base.get_input_embeddings().weight.dtype
        for name, param in self.model.named_parameters():
            if param.requires_grad and f"{HEAD}." in name and "lora_" not in name:
                param.data = param.data.to(dtype)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset  # already tokenized and packed by erniekit_lite.data.pairs


def build_trainer(model, tokenizer, args, data, plan: RunPlan):
    trainer = ErnieRewardTrainer(model=model, args=args,
                                 **trainer_inputs(data, tokenizer, plan, PackedPairCollator, PaddedPairCollator))
    # the head itself, or under LoRA peft's trained copy of it (modules_to_save; the original stays frozen beside it)
    trained = sum(p.numel() for n, p in trainer.model.named_parameters() if p.requires_grad and f"{HEAD}." in n)
    if trained != getattr(unwrap(trainer.model), HEAD).in_features:
        raise UserError(f"rm: the reward head ({HEAD}) is not trained in full ({trained} trainable weights)")
    return trainer


METRICS = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")


def last_metrics(trainer) -> dict:
    """TRL's reward metrics of the last logged training step (averaged over its logging window), for train_results.json."""
    logged = [h for h in trainer.state.log_history if "accuracy" in h and "loss" in h]
    return {k: logged[-1][k] for k in METRICS if logged and k in logged[-1]}


METHOD = runner.Method(
    prepare=prepare_pairs, describe=describe_pairs, build_trainer=build_trainer, trained=lambda data: len(data.train.pairs),
    metrics=last_metrics, summary=lambda metrics: f"reward accuracy {metrics.get('accuracy', float('nan')):.2f}, ",
)
