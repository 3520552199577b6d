"""The Train tab's form: the common recipe keys as fields, kept in sync with the YAML editor.

YAML -> form: the text is read by `erniekit_lite.recipe.load`, so a mistake is its one-line message with the line.
Form -> YAML: the values are set on the recipe's dump, validated by `recipe.from_dict` and written by
`Recipe.to_yaml` (the full resolved recipe; comments in the YAML do not survive a form edit).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from erniekit_lite import recipe as recipes
from erniekit_lite.errors import RecipeError
from erniekit_lite.recipe import (
    FORMATS,
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
    kind: str  # text | paths | choice | bool | int | number
    choices: tuple[str, ...] = ()


FIELDS = (
    Field("model.path", "model path", "text"),
    Field("method", "method", "choice", get_args(Recipe.model_fields["method"].annotation)),  # every method the recipe takes
    Field("data.train", "data files (one per line)", "paths"),
    Field("data.format", "data format (of every file)", "choice", FORMATS),
    Field("data.max_length", "max length (tokens)", "int"),
    Field("data.packing", "packing", "bool"),
    Field("lora", "LoRA (off: full fine-tuning)", "bool"),
    Field("lora.r", "LoRA r", "int"),
    Field("lora.alpha", "LoRA alpha", "number"),
    Field("train.learning_rate", "learning rate", "number"),
    Field("train.max_steps", "max steps (blank: epochs decide)", "int"),
    Field("train.num_train_epochs", "epochs", "number"),
    Field("train.per_device_train_batch_size", "batch size (rows per device)", "int"),
    Field("train.logging_steps", "log every N steps", "int"),
    Field("output.dir", "output dir", "text"),
)
_SECTIONS = {"model": ModelSection, "data": DataSection, "lora": LoraSection, "output": OutputSection}


def help_text(field: Field) -> str:
    """The one help string the key already has: its recipe `Field(description=...)`, or TRL's help for train: keys."""
    section, _, key = field.key.partition(".")
    if section == "train":
        import dataclasses

        from trl import SFTConfig

        help_ = next(f.metadata.get("help", "") for f in dataclasses.fields(SFTConfig) if f.name == key)
        return help_.split(". ")[0].rstrip(".") + "."
    if field.key == "data.format":
        return Source.model_fields["format"].description
    if not key:
        return Recipe.model_fields[section].description
    return _SECTIONS[section].model_fields[key].description


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
    """The form's values, in FIELDS order. None in a train: field means the key is not set (TRL's default)."""
    formats = {s.format for s in recipe.data.train}
    lora = recipe.lora or LoraSection()
    special = {
        "data.train": "\n".join(s.path for s in recipe.data.train),
        "data.format": formats.pop() if len(formats) == 1 else None,  # mixed: left as each source says
        "lora": recipe.lora is not None,
        "lora.r": lora.r,
        "lora.alpha": lora.alpha,
    }
    out = []
    for field in FIELDS:
        section, _, key = field.key.partition(".")
        if field.key in special:
            out.append(special[field.key])
        elif section == "train":
            out.append(recipe.train.get(key))
        else:
            out.append(getattr(getattr(recipe, section), key) if key else getattr(recipe, section))
    return out


def apply(recipe: Recipe, form: list[Any]) -> Recipe:
    """`recipe` with the form's values, validated like a recipe file (RecipeError naming the key)."""
    raw = recipe.model_dump(mode="json")
    given = dict(zip((f.key for f in FIELDS), (_typed(f, v) for f, v in zip(FIELDS, form))))
    previous = {s["path"]: s for s in raw["data"]["train"]}  # a listed file keeps its split and max_samples
    fmt = given.pop("data.format")
    raw["data"]["train"] = [
        {**previous.get(p, {"path": p}), **({"format": fmt} if fmt else {})} for p in given.pop("data.train")
    ]
    lora = {**(raw["lora"] or {}), "r": given.pop("lora.r"), "alpha": given.pop("lora.alpha")}
    raw["lora"] = lora if given.pop("lora") else None
    for key, value in given.items():
        section, _, name = key.partition(".")
        if not name:
            raw[section] = value
        elif value is None and section == "train":
            raw["train"].pop(name, None)
        else:
            raw[section][name] = value
    return recipes.from_dict(raw, source="form")


def _typed(field: Field, value: Any) -> Any:
    if field.kind == "paths":
        return [line.strip() for line in (value or "").splitlines() if line.strip()]
    if field.kind == "int" and isinstance(value, float) and value.is_integer():
        return int(value)
    if field.kind == "text":
        return (value or "").strip()
    return value
