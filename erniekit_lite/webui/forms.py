"""The Train tab's form: the common recipe keys as fields, plus each method's own `train:` keys (DPO's beta and
loss_type, SimPO's simpo_gamma, KTO's weights, ...) shown only while that method is chosen; kept in sync with the
YAML editor.

YAML -> form: the text is read by `erniekit_lite.recipe.load`, so a mistake is its one-line message with the line.
Form -> YAML: the values are set on the recipe's dump, validated by `recipe.from_dict` and written by
`Recipe.to_yaml` (the full resolved recipe; comments in the YAML do not survive a form edit).

Changing the method drops the `train:` keys that belong to the old method (see `kept_on_switch`): a DPO beta is no
SimPO beta, and SFT has none; the new method's own keys start from TRL's defaults, and the status line names what
was removed (`dropped`).

A key may have one field per method where the methods' configs differ in kind (`train.loss_type`: several of DPO's
losses, one of KTO's); the method shows one of them at a time.

What the recipe refuses (PiSSA or OLoRA for a method with a reference among them) a form edit refuses, in the
recipe's words. What needs the model (DoRA, or an init other than true or gaussian, on the MoE's routed experts) or
TRL's config (`loss_weights`: one per `loss_type`) is said by Validate's plan, as `erniekit-lite validate` says it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from erniekit_lite import recipe as recipes
from erniekit_lite.errors import RecipeError
from erniekit_lite.recipe import (
    FORMATS,
    REWARD_NAMES,
    DataSection,
    LoraSection,
    ModelSection,
    OutputSection,
    Recipe,
    Source,
)


@dataclass(frozen=True)
class Field:
    key: str  # dotted recipe key; three are not plain keys: see `values`
    label: str
    kind: str  # text | paths | choice | choices (several) | bool | int | number | numbers (a list, "0.8, 0.2")
    choices: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()  # shown only for these methods; () for every method


METHODS = get_args(Recipe.model_fields["method"].annotation)  # every method the recipe takes


def _loss_types(method: str) -> tuple[str, ...]:
    """The loss_type values the recipe takes for the method (its TRL config field's, `recipe.listed_choices`)."""
    field = next(f for f in dataclasses.fields(recipes.train_config_class(method)) if f.name == "loss_type")
    return recipes.listed_choices(field)


# lora.init as the form offers it: "true" is YAML's `init: true` (peft's default); pissa_niter_K is typed or set in the YAML
LORA_INITS = ("true", "gaussian", "orthogonal", "mica", "pissa", "olora")


FIELDS = (
    Field("model.path", "model path", "text"),
    Field("method", "method", "choice", METHODS),
    Field("data.train", "data files (one per line)", "paths"),
    Field("data.format", "data format (of every file)", "choice", FORMATS),
    Field("data.max_length", "max length (tokens)", "int"),
    Field("data.packing", "packing", "bool"),
    Field("lora", "LoRA (off: full fine-tuning)", "bool"),
    Field("lora.r", "LoRA r", "int"),
    Field("lora.alpha", "LoRA alpha", "number"),
    Field("lora.use_rslora", "rsLoRA", "bool"),
    Field("lora.use_dora", "DoRA", "bool"),
    Field("lora.init", "LoRA init (pissa_niter_K: type it)", "choice", LORA_INITS),
    Field("lora.plus_lr_ratio", "LoRA+ ratio (blank: off)", "number"),
    Field("train.learning_rate", "learning rate", "number"),
    Field("train.max_steps", "max steps (blank: epochs decide)", "int"),
    Field("train.num_train_epochs", "epochs", "number"),
    Field("train.per_device_train_batch_size", "batch size (rows per device)", "int"),
    Field("train.logging_steps", "log every N steps", "int"),
    Field("train.ema", "weight EMA decay (blank: off; OUTPUT/ema)", "number"),  # train.ema.decay; start stays as the YAML has it
    Field("train.offload", "offload to host memory, for a GPU smaller than the plan (blank: none)", "choice",
          recipes.OFFLOAD_MODES[1:]),
    Field("output.dir", "output dir", "text"),
    # Each method's own train: keys (TRL's config field names; help from the method's config class)
    Field("train.beta", "beta", "number", methods=("dpo", "orpo", "simpo", "kto", "grpo")),
    Field("train.loss_type", "loss type (several: summed, see loss_weights)", "choices", _loss_types("dpo"), methods=("dpo",)),
    Field("train.loss_weights", "loss weights (one per loss type, in its order; blank: 1 each)", "numbers", methods=("dpo",)),
    Field("train.loss_type", "loss type (blank: kto)", "choice", _loss_types("kto"), methods=("kto",)),
    Field("train.simpo_gamma", "SimPO gamma (target reward margin)", "number", methods=("simpo",)),
    Field("train.cpo_alpha", "cpo_alpha (blank: 0, pure SimPO; > 0: CPO-SimPO)", "number", methods=("simpo",)),
    Field("train.desirable_weight", "desirable weight", "number", methods=("kto",)),
    Field("train.undesirable_weight", "undesirable weight", "number", methods=("kto",)),
    Field("train.center_rewards_coefficient", "center rewards coefficient", "number", methods=("rm",)),
    Field("train.num_generations", "generations per prompt (a group)", "int", methods=("grpo",)),
    Field("train.max_completion_length", "max completion length (tokens)", "int", methods=("grpo",)),
    Field("train.temperature", "sampling temperature", "number", methods=("grpo",)),
    # erniekit-lite's own train: keys (recipe.OWN_TRAIN_KEYS; help from there)
    Field("train.router_z_loss_coef", "MoE router z-loss (blank: 0, off)", "number", methods=recipes.OWN_TRAIN_KEYS["router_z_loss_coef"].methods),
    Field("train.router_orthogonal_loss_coef", "MoE router orthogonal loss (blank: 0, off; full fine-tuning)", "number",
          methods=recipes.OWN_TRAIN_KEYS["router_orthogonal_loss_coef"].methods),
    # The built-in rewards by name; function and reward-model entries (and weights, args) are kept as the YAML has them
    Field("rewards", "built-in rewards (your own functions and reward models: in the YAML)", "choices", REWARD_NAMES,
          methods=("grpo",)),
)
GRPO_START = [{"name": "exact_answer"}]  # a switch to grpo needs a reward: the one that checks answers
_SECTIONS = {"model": ModelSection, "data": DataSection, "lora": LoraSection, "output": OutputSection}


def shown(field: Field, method: str) -> bool:
    """Whether the form shows `field` while `method` is chosen."""
    return not field.methods or method in field.methods


def method_note(method: str) -> str:
    """What the form says about a method beyond its fields (Markdown; "" for none)."""
    if method == "kto":
        from erniekit_lite.data.formats import FEEDBACK_LABELS

        names = " or ".join(f"`{name}`" for name in FEEDBACK_LABELS)
        return (f"KTO reads each record's label from its {names} field: true for a desirable completion, false for an "
                "undesirable one (no recipe key: the field names are fixed).")
    if method == "simpo":
        return "SimPO is TRL's CPO with `loss_type: simpo`, set for you: leave `train.loss_type` out."
    if method == "grpo":
        return ("GRPO samples `num_generations` answers to each prompt (transformers' `generate`), scores them with the "
                "rewards and trains on the group's advantages. Your own reward functions (`function: file.py:name`), a "
                "reward model (`model: RUN`), weights and `args` go in the YAML's `rewards:` list.")
    return ""


def help_text(field: Field, method: str | None = None) -> str:
    """The one help string the key already has: its recipe `Field(description=...)`, or the help of the TRL config
    field of `method` (default: the first method that shows the field) for train: keys. A short help is given
    whole, a long one up to its first full stop."""
    section, _, key = field.key.partition(".")
    if section == "train" and key in recipes.OWN_TRAIN_KEYS:
        help_ = recipes.OWN_TRAIN_KEYS[key].help
    elif section == "train":
        method = method if method in (field.methods or METHODS) else (field.methods or ("sft",))[0]
        help_ = next(f.metadata.get("help", "") for f in dataclasses.fields(recipes.train_config_class(method)) if f.name == key)
    elif field.key == "data.format":
        help_ = Source.model_fields["format"].description
    elif not key:
        help_ = Recipe.model_fields[section].description
    else:
        help_ = _SECTIONS[section].model_fields[key].description
    return help_ if len(help_) <= 120 else re.split(r"\. (?=[A-Z])", help_)[0].rstrip(".") + "."  # not at "Eq. 2"


def parse(text: str, name: str) -> Recipe:
    """The editor's text as a Recipe, read by the recipe module; errors name the recipe as `name:LINE`."""
    with tempfile.TemporaryDirectory(prefix="erniekit-webui-") as tmp:
        path = Path(tmp) / Path(name).name
        path.write_text(text, encoding="utf-8")
        try:
            return recipes.load(path)
        except RecipeError as e:
            e.args = (str(e).replace(f"{tmp}{os.sep}", ""),)  # the temporary copy means nothing to the user
            raise


def values(recipe: Recipe) -> list[Any]:
    """The form's values, in FIELDS order. None in a train: field means the key is not set (TRL's default), and
    in a field the method does not show."""
    formats = {s.format for s in recipe.data.train}
    lora = recipe.lora or LoraSection()  # LoRA off: the lora.* fields show the defaults, and are not written
    special = {
        "data.train": "\n".join(s.path for s in recipe.data.train),
        "data.format": formats.pop() if len(formats) == 1 else None,  # mixed: left as each source says
        "lora": recipe.lora is not None,
        **{f.key: getattr(lora, f.key.removeprefix("lora.")) for f in FIELDS if f.key.startswith("lora.")},
        "lora.init": "true" if lora.init is True else lora.init,
        "train.ema": (recipe.train.get("ema") or {}).get("decay"),
    }
    out = []
    for field in FIELDS:
        section, _, key = field.key.partition(".")
        if field.key in special:
            out.append(special[field.key])
        elif not shown(field, recipe.method):
            out.append(None)
        elif field.key == "rewards":
            out.append([entry.name for entry in recipe.rewards or [] if entry.name is not None])
        elif section == "train":
            value = recipe.train.get(key)
            if field.kind == "choices" and isinstance(value, str):
                value = [value]
            elif field.kind == "numbers" and value is not None:
                value = ", ".join(str(v) for v in (value if isinstance(value, list) else [value]))
            out.append(value)
        else:
            out.append(getattr(getattr(recipe, section), key) if key else getattr(recipe, section))
    return out


def apply(recipe: Recipe, form: list[Any]) -> Recipe:
    """`recipe` with the form's values, validated like a recipe file (RecipeError naming the key).

    Fields the chosen method does not show are left out. When the form changes the method, the old method's own
    train: keys are dropped (`kept_on_switch`) and its fields' values, still in the form, are not written.
    """
    raw = recipe.model_dump(mode="json")
    method = form[[f.key for f in FIELDS].index("method")]
    fields = [f for f in FIELDS if shown(f, method) and not (f.methods and method != recipe.method)]
    given = {f.key: _typed(f, v) for f, v in zip(FIELDS, form) if f in fields}
    if method != recipe.method:
        kept = kept_on_switch(recipe.method, method)
        raw["train"] = {k: v for k, v in raw["train"].items() if k in kept}
        raw["rewards"] = GRPO_START if method == "grpo" else None  # rewards: is grpo's alone, and grpo needs one
    if "rewards" in given:
        raw["rewards"] = _rewards(raw["rewards"] or [], given.pop("rewards") or [])
    previous = {s["path"]: s for s in raw["data"]["train"]}  # a listed file keeps its split and max_samples
    fmt = given.pop("data.format")
    raw["data"]["train"] = [
        {**previous.get(p, {"path": p}), **({"format": fmt} if fmt else {})} for p in given.pop("data.train")
    ]
    lora = {**(raw["lora"] or {}), **{k.removeprefix("lora."): given.pop(k) for k in list(given) if k.startswith("lora.")}}
    if lora["init"] == "true":
        lora["init"] = True  # YAML's `init: true`
    raw["lora"] = lora if given.pop("lora") else None
    if "train.ema" in given:  # the form's number is the decay; a start set in the YAML stays
        decay = given.pop("train.ema")
        if decay is None:
            raw["train"].pop("ema", None)
        else:
            raw["train"]["ema"] = {**(raw["train"].get("ema") or {}), "decay": decay}
    for key, value in given.items():
        section, _, name = key.partition(".")
        if not name:
            raw[section] = value
        elif value is None and section == "train":
            raw["train"].pop(name, None)
        elif section == "train" and value == [raw["train"].get(name)]:  # `loss_type: sigmoid` stays as written
            continue
        else:
            raw[section][name] = value
    return recipes.from_dict(raw, source="form")


@functools.cache
def _config_fields(method: str) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(recipes.train_config_class(method)) if f.init)


def kept_on_switch(old: str, new: str) -> frozenset[str]:
    """The train: keys that survive a change of method from `old` to `new`: all of them between methods trained
    with one TRL config class (sft and pt: SFTConfig), else those that every method's config has (learning_rate,
    max_steps, ...). The rest are the old method's own (beta, loss_type, ...): meaningless or different for the
    new one (SimPO's beta 2.0 is no DPO beta; SFTConfig and DPOConfig both have a loss_type, with other values).
    erniekit-lite's own keys (recipe.OWN_TRAIN_KEYS) survive where both methods take them (train.ema: all)."""
    own = frozenset(k for k, key in recipes.OWN_TRAIN_KEYS.items() if old in key.methods and new in key.methods)
    if recipes.train_config_class(old) is recipes.train_config_class(new):
        return _config_fields(new) | own
    return frozenset.intersection(*(_config_fields(m) for m in METHODS)) | own


def _rewards(entries: list[dict], names: list[str]) -> list[dict]:
    """rewards: with the built-ins named in the form: those still named keep their weight and args, new ones come
    with weight 1, unnamed ones go; function and reward-model entries stay."""
    have = {e.get("name") for e in entries}
    return [e for e in entries if e.get("name") is None or e["name"] in names] + [{"name": n} for n in names if n not in have]


def dropped(before: Recipe, after: Recipe) -> str:
    """The status line for an edit that changed the method: which train: keys (and rewards) it removed or added
    ("" for none)."""
    if before.method == after.method:
        return ""
    gone = [f"train.{k}" for k in before.train if k not in after.train] + (["rewards"] if before.rewards else [])
    said = []
    if gone:
        said.append(f"removed {', '.join(gone)} ({before.method}'s own settings; {after.method}'s start from TRL's defaults)")
    if after.method == "grpo":
        said.append(f"rewards: {', '.join(e.name for e in after.rewards)} to start with (choose the rewards below)")
    return f"method {after.method}: {'; '.join(said)}" if said else ""


def _typed(field: Field, value: Any) -> Any:
    if field.kind == "paths":
        return [line.strip() for line in (value or "").splitlines() if line.strip()]
    if field.kind == "int" and isinstance(value, float) and value.is_integer():
        return int(value)
    if field.kind == "choices":
        return list(value) if value else None  # none chosen: not set (TRL's default)
    if field.kind == "numbers":
        text = value or ""
        try:
            return [float(n) for n in re.split(r"[\s,]+", text.strip()) if n] or None  # blank: not set
        except ValueError:
            raise RecipeError("form", f"{field.key}: expected numbers separated by commas (got {text!r})") from None
    if field.kind == "text":
        return (value or "").strip()
    return value
