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


class TokenLoss:
    """SFT's and pt's loss: the negative log-likelihood of each trained token (the unit), with the LM head run only
    at those positions in memory-bounded chunks (`scoring.py`, the model's `score_labels=` forward: ERNIE's 103k-row
    head dominates small models), the token accuracy from the same pass, and for an MoE the router's aux loss (a
    mean over the step's micro-batches) and the z-loss and orthogonal loss (`router_losses.RouterLosses`).
    `train.loss_type: dft` weighs each token's NLL by its probability, not back-propagated (Dynamic Fine-Tuning, as
    TRL 1.16's SFT computes it); `chunked_nll` is `nll` here (the head always runs in chunks)."""

    def __init__(self, aux, router, dft: bool = False):
        self.aux, self.router, self.dft = aux, router, dft  # trainer.RouterAux, router_losses.RouterLosses

    def units(self, batch: dict) -> int:
        if "score_total" in batch:  # a sequence-parallel cut (data/sequence_shard.py): the whole row's, scored on each
            return batch["score_total"]
        targets = batch.get("score_targets")
        if targets is not None:  # counted by the collator (`collate.host_facts`)
            return targets.numel()
        from erniekit_lite.data.collate import labelled_positions

        return labelled_positions(batch["labels"])[1].numel()  # another collator's batch: a read from the device

    def chosen_tokens(self, batch: dict) -> int:
        return 0

    def real_tokens(self, batch: dict) -> int:
        from erniekit_lite.train.step import real_tokens

        return real_tokens(batch)

    def count_step(self, batches: list, trainer, device) -> None:
        self.router.count_step(batches, trainer.args, trainer.accelerator, device)

    def __call__(self, model, batch: dict, trainer, real: int):
        from erniekit_lite.train.trainer import Parts

        labels = batch.pop("labels")
        scores = model(**batch, score_labels=labels, output_router_logits=self.aux.enabled,
                       score_router_logits=bool(self.router.z_coef))
        n = scores.log_probs.numel()
        metrics = {"mean_token_accuracy": (scores.is_top1.sum(), n)}
        step = trainer.step_counts if model.training else None
        steps = step.micro_batches if step is not None else None
        scaled = 0.0
        if scores.aux_loss is not None:
            scaled = self.aux.coef * scores.aux_loss / (steps or 1)
            metrics["aux_loss"] = (scores.aux_loss, 1)
        processes = step.processes if step is not None else 1
        scaled = scaled + self.router.terms(model, scores, batch.get("attention_mask"), real, steps, metrics, processes)
        nll = -scores.log_probs
        if self.dft:
            nll = nll * scores.log_probs.detach().exp()
        return Parts(total=nll, scaled=scaled, metrics=metrics)  # per token, in row order


def token_trainer(model, args, **inputs):
    """The project's Trainer with SFT's (and pt's) token loss."""
    from erniekit_lite.train.router_losses import RouterLosses
    from erniekit_lite.train.trainer import Trainer, ready

    return Trainer(model=model, args=args, loss=TokenLoss(ready(model, args), RouterLosses(), args.loss_type == "dft"), **inputs)


def build_trainer(model, tokenizer, args, data: PreparedData, plan: RunPlan):
    if plan.vl:  # rows of image-text samples, always laid end to end (data.packing: false puts one in a row)
        from erniekit_lite.data.vl_rows import VLPackedCollator

        inputs = vl_trainer_inputs(data, tokenizer, plan, VLPackedCollator)
    else:
        inputs = trainer_inputs(data, tokenizer, plan, PackedCollator, PaddedCollator)
    return token_trainer(model, args, **inputs)


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
