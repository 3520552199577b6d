"""The Trainer arguments of every method but GRPO: transformers' `TrainingArguments` plus the fields the method's
loss reads, with the defaults (and the help) TRL 1.16's configs gave them, so a recipe that leaves a key out trains as
it did and the web UI's help reads as before.

A recipe's `train:` keys are checked against these classes (recipe.py, through `train_fields.json`), each with its
file:line; GRPO's keys are TRL's `GRPOConfig`'s, since GRPO runs on TRL's trainer. TRL's keys that only its own data
preparation or model loading read (`dataset_text_field`, `pad_token`, `model_init_kwargs`, ...) have no field here and
are refused, naming what does it in erniekit-lite (`recipe.TRLS_OWN_KEYS`).
"""

from dataclasses import dataclass, field

from transformers import TrainingArguments


def _help(text: str, choices: tuple | None = None) -> dict:
    return {"help": text, **({"choices": list(choices)} if choices is not None else {})}


@dataclass
class MethodArguments(TrainingArguments):
    """What every method shares."""

    learning_rate: float = field(default=2e-5, metadata=_help('The initial learning rate for AdamW.'))
    logging_steps: float = field(default=10, metadata=_help(
        ('Log every X updates steps. Should be an integer or a float in range `[0,1)`. If smaller than 1, '
        'will be interpreted as ratio of total training steps.')))
    gradient_checkpointing: bool = field(default=True, metadata=_help(
        ('Enable gradient checkpointing to trade compute for memory. Reduces memory at the cost of ~20% '
        'slower training.')))
    bf16: bool | None = field(default=None, metadata=_help(
        ('Whether to use bf16 (mixed) precision instead of 32-bit. Requires Ampere or higher NVIDIA '
        'architecture or Intel XPU or using CPU (use_cpu) or Ascend NPU. If not set, it defaults to '
        '`True` if `fp16` is not set.')))

    def __post_init__(self):
        self.bf16 = not self.fp16 if self.bf16 is None else self.bf16
        super().__post_init__()


@dataclass
class _Router:
    """The MoE aux loss's coefficient, for the methods that add it (ORPO's and SimPO's take the config's own; the
    reward model adds none)."""

    router_aux_loss_coef: float | None = field(default=None, metadata=_help(
        ('Coefficient of the load-balancing auxiliary loss for Mixture-of-Experts (MoE) models, added to '
        'the training loss with this weight. When not set, the value declared by the model config is '
        'used. Set to `0.0` to disable it. Fails when used with a non-MoE model.')))


@dataclass
class TokenArguments(_Router, MethodArguments):
    """SFT's and pt's: the token loss (sft.TokenLoss)."""

    loss_type: str = field(default="nll", metadata=_help(
        ("Type of loss to use. Possible values are `'nll'` (standard negative log-likelihood) and `'dft'` "
        '(Dynamic Fine-Tuning, https://huggingface.co/papers/2508.05629).'), ("nll", "dft", "chunked_nll")))


@dataclass
class _Reference:
    """DPO's and KTO's reference (train/reference.py)."""

    precompute_ref_log_probs: bool = field(default=False, metadata=_help(
        ('Whether to precompute the reference model log probabilities for the entire training dataset '
        'before training. This allows to save memory during training, as the reference model does not '
        'need to be kept in memory.')))
    precompute_ref_batch_size: int | None = field(default=None, metadata=_help(
        ('Batch size to use when precomputing reference model log probabilities. This can be set higher '
        'than the training batch size to speed up preprocessing. If `None`, defaults to '
        '`per_device_train_batch_size` for training and `per_device_eval_batch_size` for evaluation.')))


DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
                  "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")


@dataclass
class DPOArguments(_Reference, _Router, MethodArguments):
    learning_rate: float = field(default=1e-6, metadata=_help('The initial learning rate for AdamW.'))
    disable_dropout: bool = field(default=True, metadata=_help('Whether to disable dropout in the model and reference model.'))
    loss_type: list[str] = field(default_factory=lambda: ["sigmoid"], metadata=_help(
        ("Type of loss to use. Possible values are: `'sigmoid'`, `'hinge'`, `'ipo'`, `'exo_pair'`, "
        "`'nca_pair'`, `'robust'`, `'bco_pair'`, `'sppo_hard'`, `'aot'`, `'aot_unpaired'`, `'apo_zero'`, "
        "`'apo_down'`, `'discopop'`, `'sft'`, `'sigmoid_norm'`. If multiple loss types are provided, they"
        ' will be combined using the weights specified in `loss_weights`.')))
    loss_weights: list[float] | None = field(default=None, metadata=_help(
        ('List of loss weights for multi-loss combinations. Used when combining multiple loss types. '
        'Example: `[0.8, 0.2, 1.0]` for MPO. If not provided, defaults to equal weights (`1.0`) for all '
        'loss types.')))
    ld_alpha: float | None = field(default=None, metadata=_help(
        ('α parameter from the LD-DPO paper, which controls the weighting of the verbose token '
        'log-probabilities in responses. If `None`, no weighting is applied to the verbose part, and the '
        'loss is equivalent to the standard DPO loss. Must be in [0.0, 1.0]: `ld_alpha=1.0` applies no '
        'weighting, and `ld_alpha=0.0` masks tokens beyond shared lengths.')))
    f_divergence_type: str = field(default="reverse_kl", metadata=_help(
        ('f-divergence regularizer between policy and reference (f-DPO paper). Possible values are: '
        '`reverse_kl` (default), `forward_kl`, `js_divergence`, `alpha_divergence`. Only the loss types '
        "built on the chosen-rejected reward difference support a non-default value: `'sigmoid'`, "
        "`'sigmoid_norm'`, `'hinge'`, `'ipo'`, `'exo_pair'`, `'robust'`, `'discopop'`, `'sft'`. The other"
        ' loss types have no valid f-divergence generalization and are rejected with a non-default value.'),
        ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")))
    f_alpha_divergence_coef: float = field(default=0.5, metadata=_help(
        ('α coefficient for the α-divergence u^-α regularizer, used only when '
        "`f_divergence_type='alpha_divergence'`.")))
    label_smoothing: float = field(default=0.0, metadata=_help(
        ('Label smoothing parameter used in Robust DPO and EXO. In Robust DPO, it is interpreted as the '
        'probability that a preference label is flipped and must lie in [0.0, 0.5); a typical value '
        'recommended by the Robust DPO paper is 0.1. In EXO, it corresponds to the ε label smoothing '
        'parameter, for which the paper recommends a typical value of 1e-3.')))
    beta: float = field(default=0.1, metadata=_help(
        ('Parameter controlling the deviation from the reference model. Higher β means less deviation from'
        " the reference model. For the IPO loss (`loss_type='ipo'`), this value is the regularization "
        'parameter denoted by τ in the [paper](https://huggingface.co/papers/2310.12036).')))
    use_weighting: bool = field(default=False, metadata=_help(
        ('Whether to apply [WPO](https://huggingface.co/papers/2406.11827)-style weighting to preference '
        "pairs using the policy's length-normalized sequence probabilities.")))
    discopop_tau: float = field(default=0.05, metadata=_help(
        ('τ/temperature parameter from the DiscoPOP paper, which controls the shape of the log-ratio '
        "modulated loss when using `loss_type='discopop'`. The paper recommends the default value "
        '`discopop_tau=0.05`.')))

    def __post_init__(self):
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError("`loss_weights` must have the same length as `loss_type` when combining multiple losses. "
                             f"Got {len(self.loss_weights)} weights for {len(self.loss_type)} loss types.")
        super().__post_init__()


@dataclass
class KTOArguments(_Reference, _Router, MethodArguments):
    learning_rate: float = field(default=1e-6, metadata=_help('The initial learning rate for AdamW.'))
    disable_dropout: bool = field(default=True, metadata=_help('Whether to disable dropout in the model and reference model.'))
    loss_type: str = field(default="kto", metadata=_help('Type of loss to use.', ("kto", "apo_zero_unpaired")))
    beta: float = field(default=0.1, metadata=_help(
        ('Parameter controlling the deviation from the reference model. Higher β means less deviation from'
        ' the reference model.')))
    desirable_weight: float = field(default=1.0, metadata=_help(
        ('Desirable losses are weighed by this factor to counter unequal number of desirable and '
        'undesirable pairs.')))
    undesirable_weight: float = field(default=1.0, metadata=_help(
        ('Undesirable losses are weighed by this factor to counter unequal number of desirable and '
        'undesirable pairs.')))


@dataclass
class ORPOArguments(MethodArguments):
    learning_rate: float = field(default=1e-6, metadata=_help('The initial learning rate for AdamW.'))
    disable_dropout: bool = field(default=True, metadata=_help('Whether to disable dropout in the model.'))
    beta: float = field(default=0.1, metadata=_help(
        ('Parameter controlling the relative ratio loss weight in the ORPO loss. In the paper, it is '
        'denoted by λ.')))


@dataclass
class CPOArguments(MethodArguments):
    """`method: simpo` (CPO's loss_type simpo with cpo_alpha 0, trainer_args.py)."""

    learning_rate: float = field(default=1e-6, metadata=_help('The initial learning rate for AdamW.'))
    disable_dropout: bool = field(default=True, metadata=_help('Whether to disable dropout in the model.'))
    beta: float = field(default=0.1, metadata=_help(
        ('Parameter controlling the deviation from the reference model. Higher β means less deviation from'
        ' the reference model.')))
    label_smoothing: float = field(default=0.0, metadata=_help('Label smoothing factor.'))
    loss_type: str = field(default="sigmoid", metadata=_help('Type of loss to use.', ("sigmoid", "hinge", "ipo", "simpo", "alphapo")))
    cpo_alpha: float = field(default=1.0, metadata=_help('Weight of the BC regularizer in CPO training.'))
    simpo_gamma: float = field(default=0.5, metadata=_help(
        "Target reward margin for the SimPO loss, used only when the `loss_type='simpo'`."))
    alpha: float = field(default=0.0, metadata=_help(
        ('Alpha parameter that controls reward function shape across all loss types. When alpha=0 '
        '(default), uses standard log probability rewards. When `alpha != 0`, applies AlphaPO '
        'transformation: `r = (1 - p^(-alpha)) / alpha` from the AlphaPO paper. This parameter works with'
        ' all loss types.')))


@dataclass
class RewardArguments(MethodArguments):
    learning_rate: float = field(default=1e-4, metadata=_help('The initial learning rate for AdamW.'))
    disable_dropout: bool = field(default=True, metadata=_help('Whether to disable dropout in the model.'))
    center_rewards_coefficient: float | None = field(default=None, metadata=_help(
        ('Coefficient to incentivize the reward model to output mean-zero rewards (proposed by [this '
        'paper](https://huggingface.co/papers/2312.09244), Eq. 2). Recommended value: `0.01`.')))


CLASSES = {"sft": TokenArguments, "pt": TokenArguments, "dpo": DPOArguments, "kto": KTOArguments, "orpo": ORPOArguments,
           "simpo": CPOArguments, "rm": RewardArguments}
