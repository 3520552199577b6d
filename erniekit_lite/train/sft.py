"""Supervised fine-tuning: what it adds to the shared run (run.py): packed or padded rows, the sample prompts."""

from __future__ import annotations

import json
from pathlib import Path

from erniekit_lite.data.collate import PackedCollator, PaddedCollator
from erniekit_lite.data.prepare import PreparedData, describe_data, prepare
from erniekit_lite.recipe import Recipe
from erniekit_lite.run_plan import RunPlan
from erniekit_lite.train import run as runner
from erniekit_lite.train.common import trainer_inputs, vl_trainer_inputs


def run(recipe: Recipe, log=print) -> Path:
    return runner.run(recipe, METHOD, log)


def prepare_data(data, tokenizer, seed: int = 42, log=print, beside: Path | None = None, images=None) -> PreparedData:
    """The recipe's data as rows; `images`: a VL model's image processor (image-text records, data/vl.py)."""
    if images is not None:
        from erniekit_lite.data.vl_rows import prepare_vl

        return prepare_vl(data, tokenizer, images, seed, log)
    return prepare(data, tokenizer, seed, log, beside)


def build_trainer(model, tokenizer, args, data: PreparedData, plan: RunPlan):
    from erniekit_lite.train.trainer import ErnieSFTTrainer

    if plan.vl:  # rows of image-text samples, always laid end to end (data.packing: false puts one in a row)
        from erniekit_lite.data.vl_rows import VLPackedCollator

        inputs = vl_trainer_inputs(data, tokenizer, plan, VLPackedCollator)
    else:
        inputs = trainer_inputs(data, tokenizer, plan, PackedCollator, PaddedCollator)
    return ErnieSFTTrainer(model=model, args=args, **inputs)


def write_samples(model, tokenizer, plan: RunPlan, out: Path | None, log=print) -> None:
    """Answer the sample prompts; save them to `out`/samples.jsonl unless `out` is None. Eagerly: compiled layers
    (model.compile_layers) would recompile for each generated length until dynamo's limit, with a warning each."""
    import torch

    from erniekit_lite.generate import answer

    lines = []
    for prompt in plan.sample_prompts:
        with torch.compiler.set_stance("force_eager"):
            text = answer(model, tokenizer, prompt, system=plan.data.system)
        log(f"sample> User: {prompt}\nsample> Assistant: {text}")
        lines.append(json.dumps({"prompt": prompt, "answer": text}, ensure_ascii=False) + "\n")
    if out is not None:
        (out / "samples.jsonl").write_text("".join(lines), encoding="utf-8")


def _answer_prompts(trainer, tokenizer, plan: RunPlan, out: Path | None, log) -> None:
    if plan.sample_prompts:
        write_samples(trainer.model, tokenizer, plan, out, log)


METHOD = runner.Method(prepare=prepare_data, describe=describe_data, build_trainer=build_trainer,
                       trained=lambda data: len(data.train.samples), finish=_answer_prompts)
