"""Continued pre-training: what it adds to the shared run (run.py): documents read as raw text, cut into pieces and
packed (data/documents.py), every token trained but each piece's first; SFT's token loss (sft.TokenLoss)."""

from __future__ import annotations

from pathlib import Path

from erniekit_lite.data.collate import PackedCollator, PaddedCollator
from erniekit_lite.data.documents import PreparedDocuments, RowsDataset, describe_documents, prepare_documents
from erniekit_lite.recipe import Recipe
from erniekit_lite.run_plan import RunPlan
from erniekit_lite.train import run as runner


def run(recipe: Recipe, log=print) -> Path:
    return runner.run(recipe, METHOD, log)


def build_trainer(model, tokenizer, args, data: PreparedDocuments, plan: RunPlan):
    from erniekit_lite.train.sft import token_trainer

    collator = PackedCollator(plan.data.max_length) if plan.data.packing else PaddedCollator(tokenizer.pad_token_id)
    # the rows read from the memory-mapped pieces as they are sampled (a corpus larger than memory never becomes one table)
    return token_trainer(model, args, train_dataset=RowsDataset(data.train.rows),
                         eval_dataset=RowsDataset(data.eval.rows) if data.eval is not None else None,
                         processing_class=tokenizer, data_collator=collator)


METHOD = runner.Method(prepare=prepare_documents, describe=describe_documents, build_trainer=build_trainer,
                       trained=lambda data: data.train.stats.documents,
                       metrics=lambda trainer: {})
