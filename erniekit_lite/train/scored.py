"""The causal LM scores the project's batches in its own forward: no forward is replaced on an instance.

A model to train (`common.load_for_training`) gets the class `scored_class(its class)`: a subclass of transformers'
class, named as it is (so `save_pretrained` writes the same `architectures`), whose forward takes

- `score_labels=`: SFT's and pt's packed rows, the LM head at trained positions only (`scoring.score`);
- a pair batch (`logp_index` among its keys): DPO, KTO, ORPO and SimPO, in a padded [2B, L-1] layout
  (`pair_scoring.pair_scores`);
- GRPO's packed generation batch (`grpo_scoring.MARK`): `grpo_scoring.completion_scores`;

and is transformers' forward for anything else (generation, a plain `model(input_ids=...)`). The reward model's
class has its own (model/reward.py).

TRL 1.16 replaces `forward` on the instance itself in its GRPO trainer (`add_fused_lm_head`, during `__init__`,
around the forward it finds then): the class is set before, so TRL's wrapper passes our keywords on to this forward;
a reference TRL builds itself (full fine-tuning: from the path, with transformers' class) gets the class too.
"""

from __future__ import annotations

import functools

from erniekit_lite.classes import same_named
from erniekit_lite.train import grpo_scoring, pair_scoring, scoring

SCORED = "_erniekit_scored"  # a class attribute: this class is a `scored_class`


@functools.cache
def scored_class(cls: type) -> type:
    """`cls` with the forward of the module doc (one class per transformers class, made once)."""
    if getattr(cls, SCORED, False):
        return cls
    parent = cls.forward

    @functools.wraps(parent)  # its signature stays transformers' (`generate` checks its keywords against it)
    def forward(self, *args, score_labels=None, score_extras=False, score_router_logits=False, **kwargs):
        if score_labels is not None:
            return scoring.score(self, score_labels, kwargs, score_extras, score_router_logits)
        if "logp_index" in kwargs:
            return pair_scoring.pair_scores(self, kwargs)
        if grpo_scoring.MARK in kwargs:
            return grpo_scoring.completion_scores(self, **kwargs)
        return parent(self, *args, **kwargs)

    # What a run sets on its model, each None/0 until set:
    # head_keep_positions: a trained LM head keeps its chunks for backward up to this many positions (the run plan's
    #   choice; 0: recomputed); the first step's out-of-memory retry sets it to 0 (train/step.py)
    # expert_load: the ExpertLoad that records each training pass's routing (train/expert_load.py `track`)
    # sequence_group: distributed.sequence_parallel's group of this process (train/sequence_parallel.py)
    return same_named(cls, __name__, forward=forward, head_keep_positions=0, expert_load=None,
                      sequence_group=None, **{SCORED: True})


def take(model, head_keep_positions: int = 0) -> None:
    """`model` (the causal LM itself, under no peft or accelerate wrapper) scores in its forward from now on."""
    model.__class__ = scored_class(type(model))
    if head_keep_positions:
        model.head_keep_positions = head_keep_positions


def without_trl_head(model) -> None:
    """TRL's fused-LM-head wrapper taken off `model`'s instance (GRPO's reference; the tests' TRL oracles); its
    class's forward, ours, runs again. A no-op where TRL put none."""
    model.__dict__.pop("forward", None)
