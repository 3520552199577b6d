"""The Trainer arguments of every method but GRPO: transformers' `TrainingArguments` plus the fields the method's
loss reads, with the defaults TRL 1.16's configs gave them (so a recipe that leaves a key out trains as before).

A recipe's `train:` keys are checked against these classes (recipe.py, through `train_fields.json`), each with its
file:line; GRPO's keys are TRL's `GRPOConfig`'s, since GRPO runs on TRL's trainer. The fields here are the project's
own: TRL's keys that only its own data preparation or model loading read (`dataset_text_field`, `pad_token`,
`model_init_kwargs`, ...) have no field and are refused, naming the recipe key that does it here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments


def _help(text: str, choices: tuple | None = None) -> dict:
    return {"help": text, **({"choices": list(choices)} if choices is not None else {})}


@dataclass
class MethodArguments(TrainingArguments):
    """What every method shares (SFT and pt use it as it is)."""

    learning_rate: float = field(default=2e-5, metadata=_help("The initial learning rate for AdamW."))
    logging_steps: float = field(default=10, metadata=_help("Log every X updates steps (a float in (0, 1): a ratio of total steps)."))
    gradient_checkpointing: bool = field(default=True, metadata=_help(
        "Activation checkpointing: recompute activations in backward to save memory (the run plan may turn it off when the run fits)."))
    bf16: bool | None = field(default=None, metadata=_help("bf16 mixed precision; None: on unless fp16 is."))
    router_aux_loss_coef: float | None = field(default=None, metadata=_help(
        "MoE: the router load-balancing loss coefficient; None: the model config's own; 0: off."))
    disable_dropout: bool = field(default=False, metadata=_help("Set every dropout probability of the model to 0."))

    def __post_init__(self):
        self.bf16 = not self.fp16 if self.bf16 is None else self.bf16
        super().__post_init__()


@dataclass
class _Reference:
    precompute_ref_log_probs: bool = field(default=False, metadata=_help(
        "Score the reference once before training (rows carry its log-probs, cached); no reference pass or copy while training."))
    precompute_ref_batch_size: int | None = field(default=None, metadata=_help(
        "Rows per batch of that pass; None: per_device_train_batch_size (per_device_eval_batch_size for the eval rows)."))


DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
                  "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")


@dataclass
class DPOArguments(_Reference, MethodArguments):
    learning_rate: float = field(default=1e-6, metadata=_help("The initial learning rate for AdamW."))
    disable_dropout: bool = field(default=True, metadata=_help("Set every dropout probability of the model to 0."))
    loss_type: list[str] = field(default_factory=lambda: ["sigmoid"], metadata=_help(
        "DPO loss type(s); several are summed with `loss_weights` (MPO: sigmoid, bco_pair, sft).", DPO_LOSS_TYPES))
    loss_weights: list[float] | None = field(default=None, metadata=_help("The weight of each loss type; None: 1 each."))
    ld_alpha: float | None = field(default=None, metadata=_help(
        "LD-DPO: the weight of the log-probs of the tokens past the shorter answer's length, in [0, 1]; None: 1."))
    f_divergence_type: str = field(default="reverse_kl", metadata=_help(
        "f-DPO's divergence between policy and reference.", ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")))
    f_alpha_divergence_coef: float = field(default=0.5, metadata=_help("α of alpha_divergence."))
    label_smoothing: float = field(default=0.0, metadata=_help(
        "robust: the probability a label is flipped, in [0, 0.5); exo_pair: ε; aot: the smoothing."))
    beta: float = field(default=0.1, metadata=_help("How far the policy may move from the reference (IPO: τ)."))
    use_weighting: bool = field(default=False, metadata=_help("WPO: weigh each pair by its length-normalised probabilities."))
    discopop_tau: float = field(default=0.05, metadata=_help("DiscoPOP's τ."))

    def __post_init__(self):
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(f"loss_weights has {len(self.loss_weights)} weights for {len(self.loss_type)} loss types")
        super().__post_init__()


@dataclass
class KTOArguments(_Reference, MethodArguments):
    learning_rate: float = field(default=1e-6, metadata=_help("The initial learning rate for AdamW."))
    disable_dropout: bool = field(default=True, metadata=_help("Set every dropout probability of the model to 0."))
    loss_type: str = field(default="kto", metadata=_help(
        "kto, or apo_zero_unpaired (APO-zero for unpaired data: no KL term).", ("kto", "apo_zero_unpaired")))
    beta: float = field(default=0.1, metadata=_help("How far the policy may move from the reference."))
    desirable_weight: float = field(default=1.0, metadata=_help("The weight of the desirable examples' losses."))
    undesirable_weight: float = field(default=1.0, metadata=_help("The weight of the undesirable examples' losses."))


@dataclass
class ORPOArguments(MethodArguments):
    learning_rate: float = field(default=1e-6, metadata=_help("The initial learning rate for AdamW."))
    disable_dropout: bool = field(default=True, metadata=_help("Set every dropout probability of the model to 0."))
    beta: float = field(default=0.1, metadata=_help("ORPO's λ: the weight of the odds-ratio term."))


@dataclass
class CPOArguments(MethodArguments):
    """`method: simpo` (CPO's loss_type simpo with cpo_alpha 0, trainer_args.py)."""

    learning_rate: float = field(default=1e-6, metadata=_help("The initial learning rate for AdamW."))
    disable_dropout: bool = field(default=True, metadata=_help("Set every dropout probability of the model to 0."))
    beta: float = field(default=0.1, metadata=_help("The reward scale."))
    label_smoothing: float = field(default=0.0, metadata=_help("The probability a label is flipped (sigmoid loss)."))
    loss_type: str = field(default="sigmoid", metadata=_help("CPO's loss type.", ("sigmoid", "hinge", "ipo", "simpo", "alphapo")))
    cpo_alpha: float = field(default=1.0, metadata=_help("The weight of the chosen answers' NLL term."))
    simpo_gamma: float = field(default=0.5, metadata=_help("SimPO's target reward margin."))
    alpha: float = field(default=0.0, metadata=_help("AlphaPO's α (0: SimPO)."))


@dataclass
class RewardArguments(MethodArguments):
    learning_rate: float = field(default=1e-4, metadata=_help("The initial learning rate for AdamW."))
    disable_dropout: bool = field(default=True, metadata=_help("Set every dropout probability of the model to 0."))
    center_rewards_coefficient: float | None = field(default=None, metadata=_help(
        "Adds this x the mean squared reward, centring rewards on 0 (None: off)."))


CLASSES = {"sft": MethodArguments, "pt": MethodArguments, "dpo": DPOArguments, "kto": KTOArguments, "orpo": ORPOArguments,
           "simpo": CPOArguments, "rm": RewardArguments}
