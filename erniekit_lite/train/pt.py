"""Continued pre-training: what it adds to the shared run (run.py): documents read as raw text, cut into pieces and
packed (data/documents.py), every token trained but each piece's first; the SFT trainer and its exact LM-head loss."""

from __future__ import annotations

from pathlib import Path

from erniekit_lite.data.collate import PackedCollator, PaddedCollator
from erniekit_lite.data.documents import PreparedDocuments, RowsDataset, describe_documents, prepare_documents
from erniekit_lite.recipe import Recipe
from erniekit_lite.run_plan import RunPlan
from erniekit_lite.train import run as runner
from erniekit_lite.train.common import rows_dataset


def run(recipe: Recipe, log=print) -> Path:
    return runner.run(recipe, METHOD, log)


def build_trainer(model, tokenizer, args, data: PreparedDocuments, plan: RunPlan):
    from erniekit_lite.train.trainer import ErnieSFTTrainer

    collator = PackedCollator(plan.data.max_length) if plan.data.packing else PaddedCollator(tokenizer.pad_token_id)
    # TRL 1.16's SFTTrainer accepts only `datasets` types, though with skip_prepare_dataset it only checks the type;
    # the Trainer itself samples any map-style dataset. So TRL gets a one-row stand-in, and the Trainer the rows,
    # read from the memory-mapped pieces as they are sampled (a corpus larger than memory never becomes one table)
    trainer = ErnieSFTTrainer(
        model=model,
        args=args,
        train_dataset=rows_dataset([data.train.rows[0]]),
        processing_class=tokenizer,
        data_collator=collator,
    )
    trainer.train_dataset = RowsDataset(data.train.rows)
    trainer.eval_dataset = RowsDataset(data.eval.rows) if data.eval is not None else None
    return trainer


METHOD = runner.Method(prepare=prepare_documents, describe=describe_documents, build_trainer=build_trainer,
                       trained=lambda data: data.train.stats.documents,
                       metrics=lambda trainer: {})
