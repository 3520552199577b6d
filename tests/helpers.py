"""What many test files share: the CLI run in-process, and a recipe file written from a few settings."""

from __future__ import annotations

from pathlib import Path

import yaml

from erniekit_lite.cli import main

ROOT = Path(__file__).resolve().parents[1]
IDENTITY = ROOT / "recipes" / "data" / "identity.jsonl"
PAIRS = ROOT / "recipes" / "data" / "identity_dpo.jsonl"


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """`erniekit-lite ARGV...` in this process: (exit status, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def write_recipe(path: Path, model_dir: Path, *, method: str = "sft", lora: dict | None = None, data: dict | None = None,
                 train: dict | None = None, model: dict | None = None, output: dict | None = None, out: Path | None = None,
                 **changes) -> Path:
    """A recipe YAML at `path` for `model_dir`: the identity demo data (its pairs for DPO) at max_length 128 unless
    `data` says otherwise; `lora` None is full fine-tuning; `out` (default: `out` beside the file) is output.dir.
    `changes` set single keys last, a double underscore for each level: `train__max_steps=4`, `lora=None`."""
    recipe = {
        "model": {"path": str(model_dir), **(model or {})},
        "method": method,
        "data": {"train": [str(PAIRS if method == "dpo" else IDENTITY)], "max_length": 128, **(data or {})},
        "output": {"dir": str(out if out is not None else path.parent / "out"), **(output or {})},
        "train": dict(train or {}),
    }
    if lora is not None:
        recipe["lora"] = lora
    for dotted, value in changes.items():
        node = recipe
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    path.write_text(yaml.safe_dump(recipe))
    return path
