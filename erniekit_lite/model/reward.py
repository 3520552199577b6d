"""ERNIE 4.5 reward models: the causal LM's body under a one-output `score` head, read at each sequence's last token.

transformers 5.23 builds `XForSequenceClassification` for most decoder models from `GenericForSequenceClassification`
and the model's own PreTrainedModel (`class Qwen3ForSequenceClassification(GenericForSequenceClassification,
Qwen3PreTrainedModel): pass`), but has none for ERNIE 4.5. The two classes below are built the same way and, when this
module is imported, registered with `AutoModelForSequenceClassification` for the ERNIE 4.5 configs (only where
transformers has no class of its own). A run dir of `method: rm` then loads with
`AutoModelForSequenceClassification.from_pretrained(run_dir)` once `erniekit_lite.model.reward` is imported
(`import erniekit_lite` alone keeps the CLI free of transformers, so it does not register them).

Loading a causal-LM checkpoint (`AutoRewardModel`) keeps every base weight: the body is `model.*` in both classes
(same `base_model_prefix`); the LM head is not loaded (ERNIE 4.5 ties it to the embeddings). `score` (hidden_size -> 1,
no bias) is new, initialised as transformers initialises any new Linear: normal(0, config.initializer_range), 0.02 in
the released configs, drawn after the seed set before the load (train.seed for a run).

Rewards (`pair_rewards`), in TRL RewardTrainer's layout (chosen rows, then rejected rows, as `logits` [2B, 1]):
- packed pair rows (data/pairs.PackedPairCollator): one forward of the body over the row with per-sample attention
  (`cu_seq_lens_*`, restarting `position_ids`, no cache), then `score` on the hidden state of each sequence's last
  token: its end-of-turn token (`<|end_of_sentence|>`), or the last kept token of a sequence cut to max_length;
- padded rows (data/pairs.PaddedPairCollator, `score`): the last position the attention mask keeps (right padding).
transformers' own forward reads the last token that is not `pad_token_id`; on rows whose last token is not the pad
token that is the same position.

`load_reward_model(path)` and `RewardModel.score(items)` score prompt + completion the way training rendered them
(the ERNIE 4.5 template pieces, the run's `data.system` and `data.max_length`): what a GRPO reward function needs.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, Ernie4_5Config, Ernie4_5_MoeConfig
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.modeling_outputs import SequenceClassifierOutputWithPast
from transformers.models.ernie4_5.modeling_ernie4_5 import Ernie4_5PreTrainedModel
from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoePreTrainedModel

from erniekit_lite.errors import UserError
from erniekit_lite.model.lora import HEAD, unwrap  # HEAD: `score`, transformers' name in every GenericForSequenceClassification


def forward(self, *args, **kwargs):
    """transformers' forward; a pair batch of data/pairs.py (`logp_index` among its keys) is scored by `pair_rewards`
    instead, in TRL's RewardTrainer layout (what its `compute_loss` reads from `outputs.logits`)."""
    if "logp_index" not in kwargs:  # TRL's own collator's batches, a plain `model(input_ids=...)`
        return GenericForSequenceClassification.forward(self, *args, **kwargs)
    return SequenceClassifierOutputWithPast(logits=pair_rewards(self, kwargs))


class Ernie4_5ForSequenceClassification(GenericForSequenceClassification, Ernie4_5PreTrainedModel):
    forward = forward
    expert_load = None  # an ExpertLoad while an MoE trains (train/expert_load.py `track`); read by `_body`
    sequence_group = None  # distributed.sequence_parallel's group of this process (train/sequence_parallel.py)


class Ernie4_5_MoeForSequenceClassification(GenericForSequenceClassification, Ernie4_5_MoePreTrainedModel):
    forward = forward
    expert_load = None
    sequence_group = None


CLASSES = {Ernie4_5Config: Ernie4_5ForSequenceClassification, Ernie4_5_MoeConfig: Ernie4_5_MoeForSequenceClassification}
for _config, _model in CLASSES.items():
    if _config not in AutoModelForSequenceClassification._model_mapping:  # transformers' own class, once it has one
        AutoModelForSequenceClassification.register(_config, _model, exist_ok=True)  # a native config: skipped without it


class AutoRewardModel:
    """`AutoModelForSequenceClassification` with one output: a causal-LM checkpoint gets a new `score` head, a
    reward model's own checkpoint loads as saved. What `model.load.load_model(..., model_class=)` calls."""

    @staticmethod
    def from_pretrained(path, **kwargs):
        config = AutoConfig.from_pretrained(path, trust_remote_code=kwargs.get("trust_remote_code", False))
        with _new_head_expected():  # these classes even where transformers has its own: they score pair batches
            return CLASSES.get(type(config), AutoModelForSequenceClassification).from_pretrained(path, num_labels=1, **kwargs)

    @staticmethod
    def from_config(config, **kwargs):
        config.num_labels = 1
        return AutoModelForSequenceClassification.from_config(config, **kwargs)  # the memory plan's shapes alone


@contextlib.contextmanager
def _new_head_expected():
    """transformers reports `score.weight` missing and `lm_head.weight` unexpected when a causal-LM checkpoint loads
    into these classes: that is the point (TRL's RewardTrainer silences the same two keys). Any other key is still
    reported, and a reward checkpoint that lacks its head is too (its config names a ...ForSequenceClassification;
    see `load_model`)."""
    saved = {cls: (cls.__dict__.get("_keys_to_ignore_on_load_missing"), cls.__dict__.get("_keys_to_ignore_on_load_unexpected"))
             for cls in CLASSES.values()}
    for cls in CLASSES.values():
        cls._keys_to_ignore_on_load_missing = list(cls._keys_to_ignore_on_load_missing or []) + [rf"^{HEAD}\.weight$"]
        cls._keys_to_ignore_on_load_unexpected = list(cls._keys_to_ignore_on_load_unexpected or []) + [r"^lm_head\."]
    try:
        yield
    finally:
        for cls, (missing, unexpected) in saved.items():
            for name, value in (("_keys_to_ignore_on_load_missing", missing), ("_keys_to_ignore_on_load_unexpected", unexpected)):
                if value is None:
                    delattr(cls, name)
                else:
                    setattr(cls, name, value)


def load_model(path: str, dtype: str = "float32", attn_implementation: str = "sdpa", trust_remote_code: bool = False,
               trainable_adapter: bool = True, load_in_4bit: bool = False):
    """`model.load.load_model` for a reward model: a causal-LM checkpoint (new head), a reward model's run dir (full or
    LoRA), or a base + reward adapter. A LoRA run dir of another method (a causal-LM adapter) is refused: merge it
    first."""
    from erniekit_lite.model.load import load_model as load

    check_start(path)
    return load(path, dtype, attn_implementation, trust_remote_code, trainable_adapter, load_in_4bit, model_class=AutoRewardModel)


def check_start(path: str) -> None:
    """A reward model starts from a full checkpoint (causal LM or reward model) or a reward run's adapter; an adapter
    trained for a causal LM (SFT, DPO, ...) would leave the head untrained and unsaved."""
    config = Path(path) / "adapter_config.json"
    if config.is_file() and json.loads(config.read_text()).get("task_type") != "SEQ_CLS":
        raise UserError(f"model.path: {path} is a LoRA run of a causal LM (SFT, DPO, ...); a reward model starts from a "
                        f"full model: merge it first (`erniekit-lite merge {path} --out DIR`) and set model.path to DIR")


def is_reward_config(config) -> bool:
    return any(name.endswith("ForSequenceClassification") for name in (getattr(config, "architectures", None) or []))


def refuse_reward_run(path: str | None, command: str) -> None:
    """The commands that generate or score text as a causal LM (chat, serve, export, eval) refuse a reward model."""
    if path is not None and is_reward_run(path):
        raise UserError(f"{path}: a reward model (method: rm) scores answers and does not generate, so `{command}` cannot use "
                        "it; score with erniekit_lite.model.reward.load_reward_model(PATH).score([(prompt, answer), ...])")


def is_reward_run(path: str) -> bool:
    """Whether a local dir holds a reward model (full, or a reward adapter) saved by `method: rm`; reads two small
    JSON files, loads nothing. False for anything else, Hub ids included."""
    folder = Path(path).expanduser()
    adapter, config = folder / "adapter_config.json", folder / "config.json"
    if adapter.is_file():
        return json.loads(adapter.read_text()).get("task_type") == "SEQ_CLS"
    if config.is_file():
        return any(a.endswith("ForSequenceClassification") for a in json.loads(config.read_text()).get("architectures") or [])
    return False


# ---------------------------------------------------------------------------------------------------------------
# Rewards


def pair_rewards(model, batch: dict) -> torch.Tensor:
    """Rewards [2B, 1] of a pair batch: chosen rows first, then rejected (TRL's RewardTrainer layout)."""
    if "packed_input_ids" in batch:
        bounds = batch["cu_seq_lens_q"]  # sequence starts, then the row's end
        inputs = {"input_ids": batch["packed_input_ids"], "position_ids": batch["packed_position_ids"],
                  **{k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}}
        ends = bounds[1:batch["input_ids"].shape[0] + 1] - 1  # each sequence's last token (not a split's pad sample)
        if model.sequence_group is not None and "sequence_tokens" in batch:  # this process holds a shard of the row
            last = _split_ends(model, inputs, batch, ends)
        else:
            hidden = _body(model, inputs, None)[0]  # [T, h]
            last = hidden[ends.to(hidden.device, torch.long)]
        rewards = model.score(last)  # packed order: chosen, rejected, chosen, rejected, ...
        return rewards.view(-1, 2, rewards.shape[-1]).transpose(0, 1).reshape(-1, rewards.shape[-1])
    return padded_rewards(model, batch["input_ids"], batch["attention_mask"])  # rows already chosen first


def _split_ends(model, inputs: dict, batch: dict, ends: torch.Tensor) -> torch.Tensor:
    """The hidden states at `ends` (positions in the whole row) when this process holds one shard of it
    (data/sequence_shard.py): each process picks the ends it holds, and a sum over the group makes them whole."""
    from erniekit_lite.model import sequence_parallel

    group = model.sequence_group
    inputs = {**inputs, sequence_parallel.KWARG: group}
    share = inputs["input_ids"].shape[1]
    hidden = _body(model, inputs, sequence_parallel.real_tokens(inputs["input_ids"], batch["sequence_tokens"], group))[0]
    local = ends.to(hidden.device, torch.long) - group.rank * share
    mine = (local >= 0) & (local < share)
    picked = hidden[local.clamp(0, share - 1)] * mine[:, None].to(hidden.dtype)
    return sequence_parallel.summed(picked, group)


def padded_rewards(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Rewards [N, 1] of right-padded rows: the head at the last position the mask keeps."""
    hidden = _body(model, {"input_ids": input_ids, "attention_mask": attention_mask}, attention_mask)
    last = attention_mask.sum(-1).to(hidden.device, torch.long) - 1
    return model.score(hidden[torch.arange(len(hidden), device=hidden.device), last])


def _body(model, inputs: dict, mask) -> torch.Tensor:
    """The body's last hidden states; on an MoE in training, expert load recorded as SFT records it (expert_load.py)."""
    tracker = getattr(model, "expert_load", None)  # transformers own class (none in 5.23) would have none
    record = tracker is not None and model.training and torch.is_grad_enabled()
    out = model.base_model(**inputs, use_cache=False, **({"output_router_logits": True} if record else {}))
    if record:
        tracker.add(out.router_logits, mask)
    return out.last_hidden_state


# ---------------------------------------------------------------------------------------------------------------
# Scoring conversations (a GRPO reward function)


@dataclass
class RewardModel:
    """A loaded reward model and its tokenizer; `score` renders each item as training rendered a prompt + completion.

    Items: `(prompt, completion)` strings; `{"prompt", "completion"}` with each a string or messages (TRL's
    prompt-completion form: the prompt's messages end with a user message, the completion holds one assistant
    message; optional "system" and "tools"); a conversation (a list of {role, content} messages, or {"messages": [...]},
    ending with the assistant message to score). Called as `model(prompts=..., completions=...)` it is a TRL reward
    function (one float per completion).
    """

    model: object
    tokenizer: object
    max_length: int | None = None  # sequences longer than this are cut as training cut them (data.max_length)
    system: str | None = None  # the system prompt for items without one (data.system)
    batch_size: int = 8

    def __post_init__(self):
        self.__name__ = "reward_model"  # TRL names a reward function by its __name__

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        return self.score([{"prompt": p, "completion": c} for p, c in zip(prompts, completions)])

    def encode(self, items: list) -> list[list[int]]:
        """Token ids of each item, exactly as the pair rows of `method: rm` hold them."""
        from erniekit_lite.data.pairs import _cut, _prompt_length  # training's own cut
        from erniekit_lite.data.template import template_for
        from erniekit_lite.data.tokenize import Tokenizer

        if isinstance(items, (str, dict)) or not isinstance(items, (list, tuple)):
            raise UserError("score: expected a list of items ((prompt, completion), {'prompt', 'completion'} or a conversation)")
        convs = [conversation(item, i, self.system) for i, item in enumerate(items)]
        samples, _ = Tokenizer(self.tokenizer, template_for(self.tokenizer))(convs, max_length=10**9)
        ids = []
        for i, sample in enumerate(samples):
            if self.max_length is not None and len(sample) > self.max_length:
                if _prompt_length(sample) >= self.max_length:
                    raise UserError(f"score: item {i}: its prompt alone is {_prompt_length(sample)} tokens, at least max_length "
                                    f"{self.max_length}; training drops such pairs, so the model has no reward for it")
                sample = _cut(sample, self.max_length)
            ids.append(sample.input_ids)
        return ids

    def score(self, items: list) -> list[float]:
        """One reward per item, in order (batched by length; right-padded, the reward read at each last token)."""
        ids = self.encode(items)
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id or 0
        base = unwrap(self.model)
        out = [0.0] * len(ids)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                width = max(len(ids[i]) for i in batch)
                input_ids = torch.tensor([ids[i] + [pad] * (width - len(ids[i])) for i in batch], device=device)
                mask = torch.tensor([[1] * len(ids[i]) + [0] * (width - len(ids[i])) for i in batch], device=device)
                for i, value in zip(batch, padded_rewards(base, input_ids, mask)[:, 0].float().tolist()):
                    out[i] = value
        self.model.train(was_training)
        return out


def conversation(item, index: int = 0, system: str | None = None):
    """One item of `RewardModel.score` as the Conversation a preference pair's chosen side becomes in training
    (data/formats.py's TRL prompt/completion parsing, then data/pairs.tokenize_pairs' turns)."""
    from erniekit_lite.data.formats import Conversation, Turn, _tools, _trl_pref, with_tools
    from erniekit_lite.data.load import Record

    if isinstance(item, Conversation):
        return item
    where = f"score: item {index}"
    if isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(x, str) for x in item):
        data = {"prompt": item[0], "chosen": item[1]}
    elif isinstance(item, dict) and "prompt" in item and "completion" in item:
        data = {**{k: v for k, v in item.items() if k != "completion"}, "chosen": item["completion"]}
    elif isinstance(item, (list, dict)):
        messages = item.get("messages") if isinstance(item, dict) else item
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise UserError(f"{where}: expected (prompt, completion), {{'prompt', 'completion'}} or a conversation "
                            f"(a list of {{role, content}} messages); got {_shown(item)}")
        if messages[-1].get("role") != "assistant":
            raise UserError(f"{where}: a conversation must end with the assistant message to score (the last one is "
                            f"{messages[-1].get('role')!r})")
        data = {"prompt": messages[:-1], "chosen": messages[-1:], **({"tools": item["tools"]} if isinstance(item, dict) and "tools" in item else {})}
    else:
        raise UserError(f"{where}: expected (prompt, completion), {{'prompt', 'completion'}} or a conversation ending with "
                        f"an assistant message; got {_shown(item)} (a bare string has no prompt/response boundary)")
    data["rejected"] = data["chosen"]  # parsed as a pair's chosen side; the other side is not used
    record = Record(data, "score", index)
    pref = _trl_pref(record)
    pref.system = with_tools(pref.system if pref.system is not None else system, _tools(record))  # as to_preference
    history = [Turn(t.user, t.assistant, False) for t in pref.history]
    return Conversation(history + [Turn(pref.prompt, pref.chosen)], pref.system)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load_reward_model(path: str, dtype: str | None = None, device: str | None = None, max_length: int | None = None,
                      system: str | None = None) -> RewardModel:
    """A `method: rm` run dir (full, or LoRA: base + adapter), or any saved ERNIE reward model, ready to `score`.

    bf16 on a CUDA GPU, fp32 on CPU unless `dtype` says otherwise; a QLoRA run on the 4-bit base it trained against.
    `max_length` and `system` default to the run's recipe.yaml (data.max_length, data.system), so items are rendered
    and cut as in training."""
    from erniekit_lite.model.load import load_tokenizer
    from erniekit_lite.model.source import adapter_base, tokenizer_path, trained_in_4bit

    if adapter_base(path) is None and Path(path).expanduser().is_dir() and not is_reward_run(path):
        raise UserError(f"{path}: not a reward model (its config names no ...ForSequenceClassification); train one with method: rm")
    cuda = torch.cuda.is_available()
    recipe = _run_recipe(path)
    data = recipe.get("data") or {}
    four_bit = trained_in_4bit(path)  # a QLoRA run: on the 4-bit base it trained against, in its dtype
    dtype = dtype or four_bit or ("bfloat16" if cuda else "float32")
    model = load_model(path, dtype, "sdpa", trainable_adapter=False, load_in_4bit=bool(four_bit))
    if not (is_reward_config(model.config) or hasattr(model, "peft_config")):
        raise UserError(f"{path}: not a reward model (its config names no ...ForSequenceClassification); train one with method: rm")
    model.to(device or ("cuda" if cuda else "cpu")).eval()
    return RewardModel(model, load_tokenizer(tokenizer_path(path)), max_length if max_length is not None else data.get("max_length"),
                       system if system is not None else data.get("system"))


def _run_recipe(path: str) -> dict:
    import yaml

    file = Path(path).expanduser() / "recipe.yaml"
    return (yaml.safe_load(file.read_text(encoding="utf-8")) or {}) if file.is_file() else {}
