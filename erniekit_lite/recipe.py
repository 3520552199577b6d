"""The recipe: typed, validated configuration read from YAML plus `dotted.key=value` overrides.

This is the only module that reads YAML. Everything downstream receives a `Recipe`, never a dict.
Help for each key is written once, in its `Field(description=...)`.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from erniekit_lite import words
from erniekit_lite.errors import RecipeError

DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FORMATS = ("auto", "erniekit", "alpaca", "sharegpt", "messages", "trl", "text", "txt")  # trl: prompt/chosen/rejected (DPO)
RAW_TEXT_FORMATS = ("text", "txt")  # method: pt only (a `text` field per record; .txt files)
CHAT_ONLY_FORMATS = ("alpaca", "sharegpt", "messages", "trl")  # not raw text: not for method: pt


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    path: str = Field(description="Hub id (baidu/ERNIE-4.5-0.3B-PT) or a local directory: base model or a run's output dir.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the weights are loaded in. Mixed precision is train.bf16 / train.fp16."
    )
    attn_implementation: Literal["auto", "packed_sdpa", "packed_varlen", "sdpa", "eager", "flash_attention_2", "flash_attention_3"] = Field(
        "auto",
        description="auto: flash_attention_2 on CUDA when installed, else PyTorch's varlen attention (packed_varlen, "
        "CUDA) for packed batches; on CPU per-sample sdpa (packed_sdpa) for packed batches; sdpa for padded ones.",
    )
    trust_remote_code: bool = Field(False, description="Run code shipped with the checkpoint. ERNIE 4.5 never needs it.")
    load_in_4bit: bool = Field(
        False, description="QLoRA: load the frozen base in 4-bit NF4 through bitsandbytes (CUDA GPU or CPU; needs lora:)."
    )
    train_vision: bool = Field(
        False, description="ERNIE-4.5-VL, full fine-tuning: also train the vision encoder and resampler (default: frozen, "
        "as LLaMA-Factory's freeze_vision_tower; LoRA's own switch is lora.vision)."
    )
    compile_layers: bool = Field(
        False, description="Compile each decoder layer with torch.compile (dynamic row length: no recompile per row), "
        "one compiled layer reused by all, so the eager step's elementwise work (RoPE, RMSNorm, SiLU x up, casts) fuses; "
        "backend train.torch_compile_backend (default inductor). Off by default: not yet measured faster on a GPU. "
        "Not with train.torch_compile, which compiles the whole model.",
    )


class Source(_Section):
    path: str = Field(description="A .json/.jsonl/.parquet/.csv file or a Hub dataset id (method: pt also: a .txt file or a folder of them).")
    format: Literal[FORMATS] = Field(
        "auto", description="auto detects from the first record and says what it chose; trl is for preference data only; "
        "text (a `text` field per record) and txt (.txt files, or a folder of them) are raw text for method: pt, where "
        "erniekit is ERNIEKit's pre-training `tgt` list."
    )
    split: str = Field("train", description="Split to read from a Hub dataset.")
    max_samples: int | None = Field(None, ge=1, description="Use only the first N records.")
    weight: float | None = Field(
        None, gt=0, description="Training sources only: this source's share of the training samples (weights are "
        "normalised over the sources; set on every source or none). The epoch keeps the sources' total sample count; "
        "a source below its share repeats, one above it is subsampled, seeded by train.seed.",
    )


class DataSection(_Section):
    train: list[Source] = Field(min_length=1, description="Training sources.")
    eval: list[Source] = Field(default_factory=list, description="Evaluation sources (or use eval_split).")
    eval_split: float = Field(0.0, ge=0.0, lt=1.0, description="Hold out this fraction of the training samples for eval.")
    max_length: int = Field(2048, ge=16, description="Tokens per sample and per packed row.")
    packing: bool = Field(True, description="Pack samples into padding-free rows (exact, per-sample attention).")
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="truncate drops the oldest turns, then cuts the last response; drop skips the sample."
    )
    system: str | None = Field(None, description="System prompt for records that have none.")
    num_proc: int | None = Field(
        None, ge=1, description="Processes that tokenize in parallel (the same samples whatever the number). Unset: one per "
        "5,000 records up to one per core, but 1 on 2 cores or fewer, where the tokenizer's own threads already use them.",
    )
    cache: bool = Field(
        True, description="Reuse tokenized samples from an earlier run with the same data files, tokenizer and settings "
        "(local files of 1 MB or more; kept in $ERNIEKIT_CACHE/data, default ~/.cache/erniekit-lite/data), and DPO/KTO "
        "reference log-probs precomputed for the same rows and model ($ERNIEKIT_CACHE/reference).",
    )

    @field_validator("train", "eval", mode="before")
    @classmethod
    def _paths_as_sources(cls, value: Any) -> Any:
        # `- data.jsonl` is shorthand for `- {path: data.jsonl}`
        if isinstance(value, (str, dict)):
            value = [value]
        if isinstance(value, list):
            return [{"path": item} if isinstance(item, str) else item for item in value]
        return value

    @model_validator(mode="after")
    def _one_eval_source(self) -> DataSection:
        if self.eval and self.eval_split:
            raise ValueError("set either data.eval or data.eval_split, not both")
        return self

    @model_validator(mode="after")
    def _weights_on_every_train_source(self) -> DataSection:
        weighted = [s.weight is not None for s in self.train]
        if any(weighted) and not all(weighted):
            missing = ", ".join(f"data.train.{i} ({s.path})" for i, s in enumerate(self.train) if s.weight is None)
            raise ValueError(f"weight is set on some training sources but not on {missing}: set it on every source or none")
        if any(s.weight is not None for s in self.eval):
            raise ValueError("weight mixes training sources; evaluation sources are used whole")
        if any(weighted) and self.eval_split:
            raise ValueError("data.eval_split with weighted sources: a repeated sample could land in both splits; "
                             "give evaluation data as data.eval instead")
        return self


def mutates_base(init) -> bool:
    """PiSSA and OLoRA take the adapter's initial product out of the base weights (peft changes them in place)."""
    return isinstance(init, str) and (init.startswith("pissa") or init == "olora")


REFERENCE_METHODS = ("dpo", "kto", "grpo")  # their reference model is the base with the adapter disabled


class LoraSection(_Section):
    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: float = Field(16, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input (ERNIEKit uses none; peft's routed-expert adapters allow none)."
    )
    targets: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        description="Module names that get adapters. On the MoE, gate_proj/up_proj/down_proj cover the dense layer-0 MLP, "
        "the shared experts and (see routed_experts) every routed expert; the router never gets one.",
    )
    routed_experts: bool = Field(
        True, description="MoE only: also adapt the fused routed-expert weights (one rank-r adapter per expert)."
    )
    vision: bool = Field(
        False, description="ERNIE-4.5-VL only: also adapt the vision encoder and the resampler (their Linear layers: "
        "attention qkv and proj, MLP fc1 and fc2, the resampler's); by default they stay frozen."
    )
    expert_r: int | None = Field(
        None, ge=1, description="MoE only: the routed experts' rank (default: r), at scale alpha / expert_r. Each token "
        "passes 6 of the 64 experts, and at r=32 their adapters are 97% of the 21B-A3B's trainable parameters, so a lower "
        "rank here is where adapter gradients and optimizer states shrink most.",
    )
    expert_compute: Literal["split", "merged"] = Field(
        "split", description="MoE only: how the routed experts' adapters run. split: each expert's tokens through "
        "x·Wᵀ + s·(x·Aᵀ)·Bᵀ, grouped over the experts, with no merged copy of the expert weights and no gradient for "
        "them; merged: peft's own path, W + s·B·A for every expert in every forward. Same adapters and results (1e-5)."
    )
    use_rslora: bool = Field(
        False, description="Rank-stabilized LoRA (peft use_rslora): scale = alpha / sqrt(r) instead of alpha / r."
    )
    use_dora: bool = Field(
        False, description="DoRA (peft use_dora): a trained magnitude per output row on top of the LoRA direction. peft has "
        "no DoRA for the MoE's fused routed experts: there it needs routed_experts: false.",
    )
    init: bool | str = Field(
        True, description="How new adapters start (peft init_lora_weights): true, gaussian, orthogonal, mica, pissa, "
        "pissa_niter_K or olora. True: A random, B zero; orthogonal needs an even r; mica: B from the base's smallest "
        "singular directions, frozen; pissa or pissa_niter_K: A and B from the base's largest singular directions, taken "
        "out of the base; olora: QR of the base, taken out of it. pissa and "
        "olora adapters are saved converted to a plain rank-2r LoRA on the unchanged base. Not on the MoE's fused routed "
        "experts (true or gaussian there) nor a 4-bit base (true or gaussian); not for DPO (pissa, olora).",
    )
    plus_lr_ratio: float | None = Field(
        None, gt=0, description="LoRA+ (peft create_loraplus_optimizer): the B matrices learn at train.learning_rate x "
        "this ratio (ERNIEKit's DPO LoRA recipes: lora_plus_scale 12).",
    )

    @field_validator("init")
    @classmethod
    def _peft_init(cls, value: bool | str) -> bool | str:
        offered = "true, gaussian, orthogonal, mica, pissa, pissa_niter_K (K a whole number) or olora"
        if value is True or value in ("gaussian", "orthogonal", "mica", "pissa", "olora") or re.fullmatch(r"pissa_niter_\d+", str(value)):
            return value
        if value is False:
            raise ValueError(f"false is peft's debugging setting (A and B random: the untrained adapter already changes the "
                             f"model); use {offered}")
        if value in ("eva", "corda", "lora_ga"):
            raise ValueError(f"{value} is computed from the training data (activations or gradients) before training, "
                             f"which is not wired here; use {offered}")
        if value == "loftq":
            raise ValueError(f"loftq quantizes the base itself and trains against that copy; for a 4-bit base use "
                             f"model.load_in_4bit (QLoRA) with init true, or use {offered}")
        raise ValueError(f"unknown init {value!r}; use {offered}")


class OutputSection(_Section):
    dir: str = Field(description="Run directory: model or adapter, tokenizer, recipe.yaml, train_results.json.")
    overwrite: bool = Field(False, description="Replace an earlier run (different or finished) in output.dir; only a run is replaced, kept aside until the first step.")
    expert_load: bool = Field(
        True, description="MoE only: record the share of tokens routed to each expert per layer, written as "
        "expert_load.json and expert_load.png (layers x experts heatmap) at each checkpoint and at the end."
    )
    sample_prompts: list[str] = Field(
        default_factory=list, description="Prompts answered greedily after training (printed and saved to samples.jsonl)."
    )


class HubSection(_Section):
    repo_id: str = Field(description="USER/NAME (or ORG/NAME) on the Hugging Face Hub to push to when training ends.")
    private: bool | None = Field(
        None, description="Blank: a new repository is created private, an existing one keeps its visibility; true: "
        "private (an existing public repository is refused); false: public.")
    merged: bool = Field(False, description="LoRA runs: push the merged model instead of the adapter.")
    revision: str | None = Field(None, description="Branch to push to (created if missing); default: main.")

    @field_validator("repo_id")
    @classmethod
    def _user_slash_name(cls, value: str) -> str:
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", value):
            raise ValueError("expected USER/NAME, e.g. my-name/ernie-4.5-0.3b-sft")
        return value


SYNC_MODES = ("every_step", "bf16", "powersgd", "local_sgd")


class DistributedSection(_Section):
    sync: Literal[SYNC_MODES] = Field(
        "every_step", description="How the processes of a multi-process DDP run agree on the update: every_step (all-reduce "
        "every gradient every step), bf16 (the same in bfloat16: half the bytes), powersgd (rank-R factors of each "
        "gradient matrix, with error feedback) or local_sgd (each process steps alone; the trained parameters are "
        "averaged every sync_every steps). For machines on a slow link (docs/distributed.md)."
    )
    sync_every: int | None = Field(None, description="sync: local_sgd only: optimizer steps between averagings (H; default 8).")
    powersgd_rank: int | None = Field(None, description="sync: powersgd only: the rank R of each gradient matrix's factors (default 4).")
    sequence_parallel: int = Field(
        1, ge=1, description="Processes that share each packed row's tokens (Ulysses attention over heads): N divides "
        "the launch's processes (data-parallel groups x N) and the model's attention heads; each process holds 1/N of "
        "a row's activations (docs/distributed.md, \"One sequence across GPUs\")."
    )

    @model_validator(mode="after")
    def _knobs_fit_the_mode(self) -> DistributedSection:
        for key, mode, default in (("sync_every", "local_sgd", 8), ("powersgd_rank", "powersgd", 4)):
            value = getattr(self, key)
            if value is not None and self.sync != mode:
                raise ValueError(f"{key} is for sync: {mode} (this recipe has sync: {self.sync})")
            if value is not None and value < 1:
                raise ValueError(f"{key}: expected a whole number >= 1 (got {value})")
            if value is None and self.sync == mode:
                object.__setattr__(self, key, default)  # not setattr: validate_assignment would run this again
        return self

    def describe(self) -> str:
        """The line `validate` and `train` print (train/sync.py does what it says)."""
        return {
            "every_step": "sync: every_step (every gradient all-reduced every optimizer step; distributed.sync)",
            "bf16": "sync: bf16 (every gradient all-reduced every step in bfloat16: half the bytes of every_step)",
            "powersgd": (f"sync: powersgd rank {self.powersgd_rank} (each gradient matrix sent as rank-{self.powersgd_rank} "
                         "factors with error feedback, from the third step; vectors and matrices the factors would not "
                         "shrink are all-reduced as they are)"),
            "local_sgd": (f"sync: local_sgd every {words.count(self.sync_every, 'step')} (no gradient all-reduce; the trained parameters "
                          f"averaged every {words.count(self.sync_every, 'optimizer step')} and at the end; each process keeps its own "
                          "optimizer state and clips its own gradients)"),
        }[self.sync]


REWARD_NAMES = ("exact_answer", "think_format", "length")  # built-in GRPO rewards (erniekit_lite/rewards.py)


class RewardEntry(_Section):
    name: Literal[REWARD_NAMES] | None = Field(
        None, description="A built-in reward: exact_answer (the final number or \\boxed{} equals the reference's), "
        "think_format (exactly one <think>...</think> before the answer), length (a penalty beyond args.target tokens)."
    )
    function: str | None = Field(
        None, description="Your own reward: 'package.module:function' or 'path/to/file.py:function', called with TRL's "
        "reward-function arguments (prompts, completions, completion_ids, answer, ...) and returning one float (or None) "
        "per completion."
    )
    model: str | None = Field(None, description="A reward model: a `method: rm` run dir, scoring prompt + completion.")
    weight: float = Field(1.0, description="This reward's weight in the sum (TRL's reward_weights).")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for a built-in (length: target).")

    @model_validator(mode="after")
    def _one_source(self) -> RewardEntry:
        given = [k for k in ("name", "function", "model") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"expected exactly one of name (a built-in: {', '.join(REWARD_NAMES)}), function "
                             f"('module:function') or model (a method: rm run dir); got {', '.join(given) or 'none'}")
        if self.function is not None and not re.fullmatch(r"[^:]+:[A-Za-z_]\w*", self.function):
            raise ValueError(f"function: expected 'package.module:function' or 'path/to/file.py:function' (got {self.function!r})")
        if self.args and self.name is None:
            raise ValueError("args are for built-in rewards (name:); a function reads what it needs from TRL's arguments")
        return self


class Recipe(_Section):
    _where: dict = PrivateAttr(default_factory=dict)  # key path -> `file:line` or the override that set it (from_dict)
    _source: str = PrivateAttr("<recipe>")
    model: ModelSection
    method: Literal["sft", "dpo", "orpo", "simpo", "kto", "rm", "pt", "grpo"] = Field(
        "sft", description="sft (chat turns), dpo (preference pairs), orpo or simpo (preference pairs, no reference model), "
        "kto (single completions labelled desirable or undesirable), rm (a reward model from preference pairs), pt "
        "(continued pre-training on raw text) or grpo (reinforcement learning from prompts and reward functions)."
    )
    data: DataSection
    lora: LoraSection | None = Field(None, description="Omit for full fine-tuning.")
    rewards: list[RewardEntry] | None = Field(
        None, description="method: grpo only: the reward functions, summed with their weights (at least one)."
    )
    train: dict[str, Any] = Field(default_factory=dict, description="TRL SFTConfig (sft), DPOConfig (dpo), KTOConfig (kto), RewardConfig (rm) or GRPOConfig (grpo) fields, checked by name.")
    output: OutputSection
    hub: HubSection | None = Field(None, description="Push the result to the Hugging Face Hub when training ends (token: HF_TOKEN or `hf auth login`).")
    distributed: DistributedSection = Field(default_factory=DistributedSection, description="How processes synchronise in a multi-process run.")

    def __eq__(self, other: object) -> bool:
        # what the recipe says, not where it was read from (`_where`): a form's rewrite equals the file it came from
        return isinstance(other, Recipe) and self.__dict__ == other.__dict__

    __hash__ = None

    @field_validator("lora", mode="before")
    @classmethod
    def _true_means_defaults(cls, value: Any) -> Any:
        # `lora: true` asks for LoRA with default settings; `lora: false` or omitting it is full fine-tuning
        if value is True:
            return {}
        return None if value is False else value

    @model_validator(mode="after")
    def _formats_fit_the_method(self) -> Recipe:
        for split in ("train", "eval"):
            for i, source in enumerate(getattr(self.data, split)):
                if self.method == "pt" and source.format in CHAT_ONLY_FORMATS:
                    raise ValueError(f"data.{split}.{i}.format '{source.format}' is chat data; method: pt reads raw text "
                                     "(auto, text, txt, or erniekit for ERNIEKit's pre-training tgt list)")
                if self.method != "pt" and source.format in RAW_TEXT_FORMATS:
                    raise ValueError(f"data.{split}.{i}.format '{source.format}' is raw text, for method: pt")
        return self

    @model_validator(mode="after")
    def _rewards_for_grpo(self) -> Recipe:
        if self.method == "grpo" and not self.rewards:
            raise ValueError("method: grpo needs rewards: a list of {name: exact_answer | think_format | length, "
                             "function: 'module:function' or model: RM_RUN_DIR, weight}")
        if self.method != "grpo" and self.rewards is not None:
            raise ValueError(f"rewards: is for method: grpo (this recipe is method: {self.method})")
        return self

    @model_validator(mode="after")
    def _reference_is_the_base(self) -> Recipe:
        # DPO, KTO and GRPO take the base with the adapter disabled as their reference; PiSSA and OLoRA move part of
        # each base weight into the adapter, so that reference would be the changed base
        if self.method in REFERENCE_METHODS and self.lora is not None and mutates_base(self.lora.init):
            raise ValueError(f"lora.init: {self.lora.init} moves part of each base weight into the adapter, and "
                             f"{self.method.upper()}'s reference is the base with the adapter disabled, which would then be "
                             f"the changed base; use lora.init true, gaussian, orthogonal or mica for {self.method}")
        return self

    @model_validator(mode="after")
    def _local_sgd_saves_on_sync_points(self) -> Recipe:
        # a checkpoint between two averagings would hold rank 0's parameters only, and resume could not be exact
        every = self.distributed.sync_every
        if self.distributed.sync == "local_sgd":
            strategy = str(self.train.get("save_strategy", "steps")).lower()
            if strategy not in ("steps", "no", "false"):
                raise ValueError(f"distributed.sync: local_sgd saves on sync points, which save_strategy {strategy} does not fall "
                                 f"on; use train.save_strategy: steps with save_steps a multiple of sync_every ({every})")
            steps = self.train.get("save_steps", 500)
            if strategy == "steps" and (not isinstance(steps, int) or steps % every):
                raise ValueError(f"distributed.sync_every {every}: train.save_steps ({steps}) must be a multiple of it, so "
                                 "every checkpoint falls on a sync point (all processes hold the same parameters)")
            # between averagings each process holds its own parameters: an evaluation there scores a mix of models
            evaluating = str(self.train.get("eval_strategy", "no")).lower()
            if evaluating == "epoch":
                raise ValueError(f"distributed.sync: local_sgd evaluates on sync points, which eval_strategy epoch does not "
                                 f"fall on; use train.eval_strategy: steps with eval_steps a multiple of sync_every ({every})")
            steps = self.train.get("eval_steps") or self.train.get("logging_steps", 10)  # the Trainer's default: logging_steps
            if evaluating == "steps" and (not isinstance(steps, int) or steps % every):
                raise ValueError(f"distributed.sync_every {every}: train.eval_steps ({steps}) must be a multiple of it, so "
                                 "every evaluation sees the averaged model (between averagings each process holds its own)")
        return self

    @model_validator(mode="after")
    def _offload_fits_the_run(self) -> Recipe:
        offload = self.train.get("offload", "none")
        if offload == "none" or offload not in OFFLOAD_MODES:  # a wrong value is said by the train: key check
            return self
        if self.model.load_in_4bit:
            raise ValueError(f"train.offload: {offload} with model.load_in_4bit: a 4-bit base is already the small plan, and "
                             "neither offload path moves bitsandbytes' 4-bit weights; use one or the other")
        if offload in ("optimizer", "auto") and self.distributed.sync == "local_sgd":
            raise ValueError(f"train.offload: {offload} steps the optimizer on host copies of the weights, which "
                             "distributed.sync: local_sgd averages on the device; use another sync, or offload: none or parameters")
        return self

    @model_validator(mode="after")
    def _qlora_needs_lora(self) -> Recipe:
        if self.model.load_in_4bit and self.lora is None:
            raise ValueError("model.load_in_4bit (QLoRA) trains adapters on a frozen 4-bit base; add a lora: section")
        return self

    def to_yaml(self) -> str:
        data = self.model_dump(mode="json", exclude_none=False)
        if self.distributed == DistributedSection():
            del data["distributed"]  # the default, which most recipes never name
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


# Keys of SFTConfig that the recipe sets from its own sections; setting them in `train:` would be two ways to do one thing.
OWNED_TRAIN_KEYS = {
    "output_dir": "output.dir",
    "max_length": "data.max_length",
    "packing": "data.packing",
    "padding_free": "data.packing",
    "dataset_kwargs": "data",
    "dataset_text_field": "data",
    "remove_unused_columns": "data",
    "completion_only_loss": "data (loss is always on assistant turns only)",
    "assistant_only_loss": "data (loss is always on assistant turns only)",
    "eval_packing": "data.packing",
    "packing_strategy": "data.packing",
    "reward_weights": "rewards (each entry's weight)",  # GRPO
}


EMA_KEYS = {"decay": None, "start": 0}


def _check_ema(value: Any, where: str) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RecipeError(where, f"train.ema: expected {{decay: 0.999, start: 0}} (got {value!r})")
    for key in value:
        if key not in EMA_KEYS:
            raise RecipeError(where, f"unknown key '{key}' in train.ema{_did_you_mean(key, list(EMA_KEYS))}")
    if "decay" not in value:
        raise RecipeError(where, "train.ema: missing required key 'decay' (e.g. 0.999)")
    decay = _check_type("ema.decay", value["decay"], 0.0, where)
    if not 0 < decay < 1:
        raise RecipeError(where, f"train.ema.decay: expected a number between 0 and 1, exclusive (got {decay!r})")
    start = _check_type("ema.start", value.get("start", 0), 0, where)
    if start < 0:
        raise RecipeError(where, f"train.ema.start: expected a whole number >= 0 (got {start!r})")
    return {"decay": float(decay), "start": int(start)}


OFFLOAD_MODES = ("none", "optimizer", "parameters", "auto")


def _check_offload(value: Any, where: str) -> str:
    if value not in OFFLOAD_MODES:
        raise RecipeError(where, f"train.offload: expected one of {', '.join(OFFLOAD_MODES)} (got {value!r})")
    return value


@dataclass(frozen=True)
class OwnTrainKey:
    """A `train:` key of erniekit-lite's own (not a TRL config field): checked like TRL's, removed before TRL's config
    is built (trainer_args.py), offered by the web UI's form and named by `validate`."""

    default: Any
    help: str
    methods: tuple[str, ...]  # the methods that take it
    lora: bool = True  # whether it means anything when LoRA freezes the rest
    check: Any = None  # (value, where) -> the value checked; None: a number >= 0


OWN_TRAIN_KEYS = {
    "router_z_loss_coef": OwnTrainKey(
        0.0, "MoE: weight of the router z-loss, the mean over real tokens of logsumexp(router logits)², summed over MoE "
        "layers (ERNIEKit's moe_z_loss_lambda; 0: off).", ("sft", "pt")),
    "router_orthogonal_loss_coef": OwnTrainKey(
        0.0, "MoE: weight of the router orthogonal loss, ||W·Wᵀ − I||² / E² of each router's row-normalised weight, "
        "summed over MoE layers (ERNIEKit's moe_orthogonal_loss_lambda; 0: off). Full fine-tuning only: LoRA "
        "leaves the router frozen.", ("sft", "pt"), lora=False),
    "ema": OwnTrainKey(
        None, "An exponential moving average of the trained parameters, written as OUTPUT/ema/ (a run dir of its own) "
        "and kept in every checkpoint: {decay: 0.999, start: 0} (the EMA follows the parameters until step `start`). "
        "With a constant learning rate, what the ERNIE 4.5 report uses instead of a decaying one.",
        ("sft", "pt", "dpo", "orpo", "simpo", "kto", "rm", "grpo"), check=_check_ema),
    "offload": OwnTrainKey(
        "none", "Move training state to host memory when the GPU is smaller than the plan (docs/offload.md): optimizer "
        "(fp32 master weights and AdamW states on the CPU, which steps them), parameters (FSDP2's CPU offload: weights, "
        "gradients and optimizer state on the host, each layer copied in as it runs), auto (the first of none and "
        "optimizer, or none and parameters under FSDP2, that fits this GPU), or none.",
        ("sft", "pt", "dpo", "orpo", "simpo", "kto", "rm", "grpo"), check=_check_offload),
}
def own_train(recipe: Recipe, key: str) -> Any:
    """An own `train:` key's value, its default when the recipe leaves it out."""
    return recipe.train.get(key, OWN_TRAIN_KEYS[key].default)


def load(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a recipe file (or a shipped recipe by name: `quickstart`, `ernie-4.5-0.3b/sft-lora`), apply `a.b=value`
    overrides and validate. Raises RecipeError with file:line."""
    from erniekit_lite import shipped

    path = Path(path)
    if not path.is_file():
        path = shipped.find(str(path)) or path
    if not path.is_file():
        stem = str(path).removeprefix(shipped.PREFIX).removesuffix(".yaml")
        close = difflib.get_close_matches(stem, shipped.names(), n=1)
        # a part of a name (`sft`, `dpo-lora`): the shipped recipes whose name has it, the first few
        parts = [name for name in shipped.names() if stem and stem in name.rsplit("/", 1)[-1]]
        if close:
            hint = f"did you mean '{close[0]}'?"
        elif parts:
            hint = f"shipped recipes with '{stem}' in their name: {', '.join(parts[:4])}{', ...' if len(parts) > 4 else ''}"
        else:
            hint = "nor a shipped recipe's name: `erniekit-lite recipes` lists them, e.g. quickstart, ernie-4.5-0.3b/sft-lora"
        raise RecipeError(str(path), f"recipe file not found ({hint})")
    text = path.read_text(encoding="utf-8")
    try:
        raw = yaml.safe_load(text)
        lines = _key_lines(yaml.compose(text))
    except yaml.YAMLError as e:
        mark, context = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        started = f" ({e.context} at line {context.line + 1})" if context and mark and context.line != mark.line else ""
        raise RecipeError(where, f"YAML syntax error: {getattr(e, 'problem', None) or e}{started}") from None
    if not isinstance(raw, dict):
        raise RecipeError(str(path), "expected a mapping of sections (model, data, train, output, ...)")
    raw = shipped.localize(raw, path)  # a shipped recipe's recipes/... data, outside a clone: the package's copy
    where = {loc: f"{path}:{line}" for loc, line in lines.items()}
    for override in overrides:
        loc = _apply_override(raw, override)
        # a problem at or under an overridden key is the override's, as typed, not the file line it replaced
        where = {k: v for k, v in where.items() if k[:len(loc)] != loc}
        where[loc] = f"override '{override}'"
    return from_dict(raw, source=str(path), lines=where)


def from_dict(raw: dict, source: str = "<recipe>", lines: dict[tuple, str] | None = None) -> Recipe:
    """`lines`: where each key path was given (`file:line`, or the override that set it), for the errors."""
    lines = lines or {}
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as e:
        raise _first_error(e, source, lines) from None
    _check_train_keys(recipe.train, source, lines, recipe.method, lora=recipe.lora is not None)
    recipe._where, recipe._source = dict(lines), source
    return recipe


def check_local_paths(recipe: Recipe) -> None:
    """A model.path or data path meant as a local file or folder that is not there, said at its recipe line with the
    closest name beside it (`did you mean runs/tiny-ernie?`), before anything heavy loads. Meant as local: it starts
    with `.`, `/` or `~`, is not `ORG/NAME` (Hub ids are), has a data file's suffix, or its folder is here (`runs/`);
    anything else is left to the Hub."""
    from erniekit_lite.data.load import _FILE_SUFFIXES, _looks_like_hub_id  # the data loader's own rule for a Hub id

    keys = [(("model", "path"), recipe.model.path, "folder")]
    for split in ("train", "eval"):
        keys += [(("data", split, str(i), "path"), source.path, "file") for i, source in enumerate(getattr(recipe.data, split))]
    for key, value, kind in keys:
        path = Path(value).expanduser()
        if path.exists() or Path(value).is_symlink():
            continue
        suffixed = kind == "file" and path.suffix.lower() in (*_FILE_SUFFIXES, ".txt")  # .txt: pt's raw text
        if _looks_like_hub_id(value) and not suffixed and not path.parent.is_dir():
            continue
        from erniekit_lite.model.source import QUICKSTART_MODEL

        siblings = [p.name for p in path.parent.iterdir()] if path.parent.is_dir() else []
        close = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.6)
        if close:
            hint = f"; did you mean {path.parent / close[0] if str(path.parent) != '.' else close[0]}?"
        elif key == ("model", "path") and Path(value) == Path(QUICKSTART_MODEL):
            hint = f"; the quick start's tiny model is made by `erniekit-lite tiny {QUICKSTART_MODEL} --arch dense`"
        else:
            hint = " (relative paths are resolved from the working directory)"
        raise RecipeError(_where(recipe._source, recipe._where, key), f"{'.'.join(key)}: {value}: no such {kind}{hint}")


def _first_error(error: ValidationError, source: str, lines: dict[tuple, str]) -> RecipeError:
    problems = []
    for err in error.errors():
        loc = tuple(str(p) for p in err["loc"])
        where = _where(source, lines, loc)
        if err["type"] == "extra_forbidden":
            section_loc, key = loc[:-1], loc[-1]
            section = ".".join(section_loc) or "the recipe"
            problems.append(RecipeError(where, f"unknown key '{key}' in {section}{_did_you_mean(key, _section_keys(section_loc))}"))
        elif err["type"] == "missing":
            problems.append(RecipeError(where, f"missing required key '{'.'.join(loc)}'"))
        else:
            value = err.get("input")
            shown = f" (got {value!r})" if not isinstance(value, (dict, list)) else ""
            msg = err["msg"].removeprefix("Value error, ")
            named = re.match(r"([a-z_]+(?:\.[a-z_]+)+): ", msg) if not loc else None
            if named:  # a whole-recipe check that names the key it is about: pointed at that key's line
                problems.append(RecipeError(_where(source, lines, tuple(named.group(1).split("."))), msg))
                continue
            if err["type"] == "literal_error" and isinstance(value, str):  # an enum typo: as every key typo, a did-you-mean
                options = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
                close = difflib.get_close_matches(value, options, n=1, cutoff=0.6) or [o for o in options if o.startswith(value)]
                msg = f"{value!r} is not one of {', '.join(options)}" + (f"; did you mean '{close[0]}'?" if close else "")
                shown = ""
            problems.append(RecipeError(where, f"{'.'.join(loc) or 'recipe'}: {msg}{shown}"))
    # a misspelt key comes first: its "did you mean" explains the "missing required key" that follows from it
    problems.sort(key=lambda p: "unknown key" not in p.args[0])
    first = problems[0]
    if len(problems) > 1:  # named, so a second run does not have to find it
        more = f"{len(problems) - 1} more: " if len(problems) > 2 else ""
        first.args = (f"{first.args[0]} (and {more}{problems[1].args[0]}{', ...' if more else ''})",)
    return first


def _section_keys(loc: tuple[str, ...]) -> list[str]:
    model: Any = Recipe
    for part in loc:
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:  # a list index: keep the element model
            continue
        model = _model_of(field.annotation)
    return list(model.model_fields) if hasattr(model, "model_fields") else []


def _model_of(annotation: Any) -> Any:
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_of(arg)
        if found is not None:
            return found
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _did_you_mean(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else f"; expected one of: {', '.join(candidates)}"


def train_config_class(method: str):
    """The Trainer arguments class whose fields a method's `train:` holds: the project's (arguments.py), and for
    GRPO, which runs on TRL's trainer, TRL's `GRPOConfig`."""
    if method == "grpo":
        import trl

        return trl.GRPOConfig
    from erniekit_lite.arguments import CLASSES

    return CLASSES[method]


# The argument classes' fields, as `_check_train_keys` reads them, for the transformers and TRL versions the file
# names: checking a recipe then imports neither (transformers, peft, bitsandbytes: ~3 s), so `train --num-processes N`
# starts its workers that much sooner. tests/test_recipe.py checks the file against the classes; `write_train_fields()`
# rewrites it after an upgrade or a change of arguments.py.
TRAIN_FIELDS = Path(__file__).with_name("train_fields.json")
FIELD_METHODS = ("sft", "pt", "dpo", "kto", "orpo", "simpo", "rm", "grpo")
# TRL's keys for its own data preparation and model loading, which erniekit-lite does itself: no field of the
# project's argument classes (GRPO, on TRL's trainer, keeps them); refused naming what does it here
TRLS_OWN_KEYS = {"model_init_kwargs": "model (model.dtype, model.attention)", "trust_remote_code": "model.trust_remote_code",
                 "chat_template_path": "the data's template", "eos_token": "the data's template", "pad_token": "the tokenizer",
                 "pad_to_multiple_of": "data.packing", "dataset_num_proc": "data.num_proc", "truncation_mode": "data.max_length",
                 "max_prompt_length": "data.max_length", "max_completion_length": "data.max_length",
                 "padding_value": "the tokenizer", "shuffle_dataset": "train.seed (rows are shuffled every epoch)", "activation_offloading": "train.offload",
                 "generate_during_eval": "output.sample_prompts", "is_encoder_decoder": "model.path"}
NOT_SUPPORTED = {"sync_ref_model": "TR-DPO's reference updates", "ref_model_mixup_alpha": "TR-DPO's reference updates",
                 "ref_model_sync_steps": "TR-DPO's reference updates"}


def train_fields_from_classes() -> dict[str, dict[str, dict]]:
    """Per method: each init field's plain-type sample (`_primitive`) and listed choices (`listed_choices`)."""
    import dataclasses

    out = {}
    for method in FIELD_METHODS:
        fields = [f for f in dataclasses.fields(train_config_class(method)) if f.init]
        choices = {f.name: listed_choices(f) for f in fields}
        out[method] = {f.name: {"sample": _primitive(f), "choices": None if choices[f.name] is None else list(choices[f.name])}
                       for f in fields}
    return out


def _field_versions() -> dict[str, str]:
    from importlib.metadata import version

    return {"transformers": version("transformers"), "trl": version("trl")}


def write_train_fields() -> None:
    TRAIN_FIELDS.write_text(json.dumps({"versions": _field_versions(), "methods": train_fields_from_classes()}, indent=0) + "\n")


@functools.cache
def _train_fields() -> dict[str, dict[str, dict]]:
    from importlib.metadata import PackageNotFoundError

    try:
        shipped = json.loads(TRAIN_FIELDS.read_text())
        if shipped["versions"] == _field_versions():
            return shipped["methods"]
    except (OSError, ValueError, KeyError, PackageNotFoundError):
        pass
    return train_fields_from_classes()  # other versions than the file's: read from the classes themselves


def _check_train_keys(train: dict[str, Any], source: str, lines: dict[tuple, int], method: str = "sft", lora: bool = False) -> None:
    fields = _train_fields()[method]
    valid = list(fields) + [k for k, own in OWN_TRAIN_KEYS.items() if method in own.methods]
    for key, value in list(train.items()):
        where = _where(source, lines, ("train", key))
        if key in OWNED_TRAIN_KEYS:
            raise RecipeError(where, f"train.{key} is set by the recipe; use {OWNED_TRAIN_KEYS[key]} instead")
        if key in OWN_TRAIN_KEYS:
            train[key] = _check_own(key, value, method, lora, where)
            continue
        if key not in valid and key in TRLS_OWN_KEYS:
            raise RecipeError(where, f"train.{key} is TRL's, for its own data preparation or model loading; erniekit-lite "
                                     f"does that itself for {method} (use {TRLS_OWN_KEYS[key]})")
        if key not in valid and key in NOT_SUPPORTED:
            raise RecipeError(where, f"train.{key}: {NOT_SUPPORTED[key]} are not supported by erniekit-lite's {method}")
        if key not in valid:
            raise RecipeError(where, f"unknown key '{key}' in train{_did_you_mean(key, valid)}")
        train[key] = _check_type(key, value, fields[key]["sample"], where)
        _check_choice(key, train[key], fields[key]["choices"], where)
        if key == "max_steps" and train[key] != -1 and train[key] < 1:  # the Trainer reads any other value as "epochs"
            raise RecipeError(where, f"train.max_steps: expected a whole number of optimizer steps, at least 1, or -1 "
                                     f"to train train.num_train_epochs (got {value!r})")
        if key == "report_to":
            _check_loggers(train[key], where)


def _check_loggers(value: Any, where: str) -> None:
    """train.report_to: loggers transformers knows and this environment has (`train` died in a traceback)."""
    names = [value] if isinstance(value, str) else list(value or [])
    if not [n for n in names if n not in ("none", "all")]:
        return
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

    for name in names:
        if name in ("none", "all"):
            continue
        if name not in INTEGRATION_TO_CALLBACK:
            raise RecipeError(where, f"train.report_to: unknown logger {name!r}{_did_you_mean(name, [*INTEGRATION_TO_CALLBACK, 'all', 'none'])}")
        if name not in get_available_reporting_integrations():
            raise RecipeError(where, f"train.report_to: {name} is not installed here (pip install {name.replace('_', '-')})")


def _check_own(key: str, value: Any, method: str, lora: bool, where: str) -> Any:
    own = OWN_TRAIN_KEYS[key]
    if method not in own.methods:
        raise RecipeError(where, f"train.{key}: method {method} does not take it (methods that do: {', '.join(own.methods)})")
    if own.check is not None:
        return own.check(value, where)
    value = _check_type(key, value, own.default, where)
    if value is not None and value < 0:
        raise RecipeError(where, f"train.{key}: expected a number >= 0 (got {value!r})")
    if lora and not own.lora and value:
        raise RecipeError(where, f"train.{key}: LoRA leaves the MoE router frozen, and this loss depends on its weight "
                          "alone; remove it or train without lora:")
    return value


def listed_choices(field) -> tuple | None:
    """The values an argument field lists: its `choices`, or for a list field without `choices` (TRL's DPO
    `loss_type`) the values its help names (`'sigmoid'`, `'ipo'`, ...)."""
    choices = field.metadata.get("choices")
    if choices is None and field.name == "loss_type":
        choices = dict.fromkeys(re.findall(r"`'(\w+)'`", field.metadata.get("help", ""))) or None
    if choices is None:  # transformers' enum fields (`SchedulerType | str`: lr_scheduler_type, optim, the strategies)
        import enum

        enums = [t for t in getattr(field.type, "__args__", ()) if isinstance(t, type) and issubclass(t, enum.Enum)]
        choices = [member.value for member in enums[0]] if enums else None
    return tuple(choices) if choices is not None else None


def _check_choice(key: str, value: Any, choices, where: str) -> None:
    """A value the config field lists its choices for (DPO's and KTO's `loss_type`, `truncation_mode`, ...): TRL
    checks some only in the middle of the first step (DPO: a traceback after loading; KTO: a failed step)."""
    if choices is None or value is None:
        return
    for item in value if isinstance(value, list) else [value]:
        if item is False and "no" in choices:  # YAML 1.1 reads `save_strategy: no` as false (trainer_args)
            continue
        if item not in choices:
            close = difflib.get_close_matches(str(item), [str(c) for c in choices], n=1)
            raise RecipeError(where, f"train.{key}: expected one of {', '.join(map(str, choices))} (got {item!r})"
                                     + (f"; did you mean '{close[0]}'?" if close else ""))


def _primitive(field: Any) -> Any:
    """A sample value of the field's type when it is a plain bool/int/float (optionally None), else None."""
    kind = field.type if isinstance(field.type, type) else None
    args = set(getattr(field.type, "__args__", ())) - {type(None)}
    if kind is None and len(args) == 1:
        kind = next(iter(args))
    return {bool: False, int: 0, float: 0.0}.get(kind)


def _check_type(key: str, value: Any, default: Any, where: str) -> Any:
    """Numbers and flags are checked against the SFTConfig field's type.

    YAML 1.1 reads `2e-5` (no dot) as a string; a number is clearly meant, so numeric strings are converted.
    """
    if value is None or default is None or isinstance(default, str):
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise RecipeError(where, f"train.{key}: expected true or false (got {value!r})")
        return value
    if isinstance(default, (int, float)):
        if isinstance(value, str):
            try:
                value = float(value) if isinstance(default, float) or not value.lstrip("-").isdigit() else int(value)
            except ValueError:
                raise RecipeError(where, f"train.{key}: expected a number (got {value!r})") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(where, f"train.{key}: expected a number (got {value!r})")
        if isinstance(default, int) and isinstance(value, float) and not value.is_integer():
            raise RecipeError(where, f"train.{key}: expected a whole number (got {value!r})")
        return int(value) if isinstance(default, int) and not isinstance(default, bool) and isinstance(value, float) else value
    return value


def _where(source: str, lines: dict[tuple, str], loc: tuple[str, ...]) -> str:
    # The deepest part of the key path that was given (a file line or an override) says where
    for n in range(len(loc), 0, -1):
        if loc[:n] in lines:
            return lines[loc[:n]]
    return source


def _key_lines(node: yaml.Node | None, prefix: tuple = ()) -> dict[tuple, int]:
    out: dict[tuple, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            loc = (*prefix, str(key_node.value))
            out[loc] = key_node.start_mark.line + 1
            out.update(_key_lines(value_node, loc))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            loc = (*prefix, str(i))
            out[loc] = item.start_mark.line + 1
            out.update(_key_lines(item, loc))
    return out


def _apply_override(raw: dict, override: str) -> tuple[str, ...]:
    """Set `dotted.key=value` in `raw`; returns the key path."""
    key, sep, value_text = override.partition("=")
    if not sep or not key:
        raise RecipeError(f"override '{override}'", "expected dotted.key=value, e.g. train.learning_rate=2e-5")
    try:
        value = yaml.safe_load(value_text) if value_text else ""
    except yaml.YAMLError:
        value = value_text
    node: Any = raw
    parts = key.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError(f"override '{override}'", f"'{'.'.join(parts[:i])}' is a list; index {part!r} is out of range")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
            continue
        if not isinstance(node, dict):
            raise RecipeError(f"override '{override}'", f"'{'.'.join(parts[:i])}' is not a section")
        if last:
            node[part] = value
        else:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
    return tuple(parts)
