"""The data of `erniekit_example.yaml`: `example.jsonl` beside this file, wherever the package is installed.

lm-eval reads `dataset_kwargs: data_files:` relative to the working directory, not to the task's YAML, so a task
that ships with its data names a loader instead (`custom_dataset: !function example.load`).
"""

import json
from pathlib import Path


def load(**kwargs):
    """The test split: one {question, choices, answer} per JSONL line (lm-eval passes its metadata as kwargs)."""
    from datasets import Dataset, DatasetDict

    lines = Path(__file__).with_name("example.jsonl").read_text(encoding="utf-8").splitlines()
    return DatasetDict({"test": Dataset.from_list([json.loads(line) for line in lines if line.strip()])})
