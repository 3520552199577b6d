"""Unpaired feedback (KTO): labelled completions, each with a KL twin, packed whole into rows, collated padding-free.

An example is a prompt (earlier turns untrained) and one completion labelled desirable or undesirable, tokenized
through the same ERNIE 4.5 template pieces as SFT samples and DPO pairs: the completion and its end-of-turn token
(labelled `</s>`) are trained, nothing else. Each example is cut to max_length by shortening its completion; a
prompt that leaves no room drops it.

KTO's reference point is a KL estimate taken on mismatched pairs: prompts followed by completions written for other
prompts. An example's *KL twin* is its own prompt followed by another example's completion. Prompt and completion
are tokenized apart (ERNIEKit's convention, template.py), so a twin is exactly the two token runs concatenated: the
same ids as tokenizing that conversation (tests/test_kto.py checks it against the real tokenizer).

Which completion (ours; TRL rotates completions by +1 within each block of `per_device_train_batch_size` examples
in dataset order): examples are packed best-fit-decreasing by their own length into groups of at most max_length
tokens, and within each group the completions are rotated by +1: the first example takes the last one's
completion, every other one the previous one's. A rotation only permutes a group's completions, so its twins hold
exactly as many tokens as its examples, each twin at most max_length: a row (examples + twins) holds at most
2 x max_length. A group of one (an example too long to share a row, or `data.packing: false`) takes the completion
of the example packed just before it (for the first row: the last example), cut to max_length as TRL's collator
cuts. The pairs are fixed when the data is made, so they hold in any row order (TRL's need sequential sampling)::

    row      [ m1 | k1 | m2 | k2 | m3 | k3 ]      m_i = prompt_i + completion_i,  k_i = prompt_i + completion_(i-1)
    batch    matched  m1 m2 m3 ... (all rows)     one packed sequence, per-sample attention, scored with grad
             KL       k1 k2 k3 ...                another, scored without grad
             TRL's padded layout per side: [B, L] ids/masks, per-token values in [B, L-1] via `logp_index`
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from erniekit_lite.data.collate import bounds, host_facts
from erniekit_lite.data.formats import Conversation, Feedback, Turn
from erniekit_lite.data.packing import best_fit_decreasing, check_first_untrained
from erniekit_lite.data.tokenize import IGNORE, Sample, Tokenizer


@dataclass
class Example:
    sample: Sample
    desirable: bool

    def __len__(self) -> int:
        return len(self.sample)

    @property
    def prompt_length(self) -> int:
        """Tokens before the completion: the first trained label starts it."""
        return next(i for i, label in enumerate(self.sample.labels) if label != IGNORE)


@dataclass
class FeedbackStats:
    kept: int = 0
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    lengths: list[int] = field(default_factory=list)  # per example, after truncation
    desirable: int = 0

    @property
    def undesirable(self) -> int:
        return self.kept - self.desirable

    def add(self, later: FeedbackStats) -> None:
        """Fold in the statistics of the examples that follow (skip reasons keep their first-seen order)."""
        self.kept += later.kept
        self.truncated += later.truncated
        self.skipped.update(later.skipped)
        self.lengths += later.lengths
        self.desirable += later.desirable


def tokenize_feedback(tokenize: Tokenizer, feedback: list[Feedback], max_length: int) -> tuple[list[Example], FeedbackStats]:
    """Each example is cut to max_length by shortening its completion; a prompt that leaves no room drops it."""
    convs = [
        Conversation([Turn(t.user, t.assistant, False) for t in f.history] + [Turn(f.prompt, f.completion)], f.system)
        for f in feedback
    ]
    samples, _ = tokenize(convs, max_length=10**9)  # cut below, keeping the whole prompt
    stats, examples = FeedbackStats(), []
    for f, sample in zip(feedback, samples):
        if sample is None:  # no trained token at all (cannot happen for ERNIE's template: the end of turn trains)
            stats.skipped["no trained tokens"] += 1
            continue
        example = Example(sample, f.desirable)
        if example.prompt_length >= max_length:
            stats.skipped["prompt longer than max_length"] += 1
            continue
        if len(sample) > max_length:
            stats.truncated += 1
            example.sample = Sample(sample.input_ids[:max_length], sample.labels[:max_length], truncated=True)
        examples.append(example)
        stats.kept += 1
        stats.desirable += f.desirable
        stats.lengths.append(len(example))
    return examples, stats


@dataclass
class FeedbackRow:
    input_ids: list[int]
    labels: list[int]
    seq_lengths: list[int]  # example, twin, example, twin, ... (examples only without KL twins)
    desirable: list[bool]  # one per example


def pack_feedback(examples: list[Example], max_length: int, packing: bool = True, kl: bool = True) -> list[FeedbackRow]:
    """Rows of whole examples, each followed by its KL twin when `kl` (see the module doc for the pairing)."""
    check_first_untrained([e.sample for e in examples], "example")
    groups = best_fit_decreasing([len(e) for e in examples], max_length) if packing else [[i] for i in range(len(examples))]
    order = [i for group in groups for i in group]
    before = {i: order[k - 1] for k, i in enumerate(order)}  # the example packed just before (the first: the last one)
    rows = []
    for group in groups:
        ids: list[int] = []
        labels: list[int] = []
        lengths = []
        for k, i in enumerate(group):
            seqs = [examples[i].sample]
            if kl:
                seqs.append(twin(examples[i], examples[group[k - 1] if len(group) > 1 else before[i]], max_length))
            for s in seqs:  # extending in place: a third of the time of nested comprehensions
                ids += s.input_ids
                labels += s.labels
                lengths.append(len(s))
        rows.append(FeedbackRow(ids, labels, lengths, [examples[i].desirable for i in group]))
    return rows


def twin(example: Example, other: Example, max_length: int) -> Sample:
    """`example`'s prompt followed by `other`'s completion (trained as it is there), cut to max_length."""
    p, q = example.prompt_length, other.prompt_length
    ids = example.sample.input_ids[:p] + other.sample.input_ids[q:]
    labels = [IGNORE] * p + other.sample.labels[q:]
    return Sample(ids[:max_length], labels[:max_length], truncated=len(ids) > max_length)


def _sides(rows: list[dict]) -> tuple[list[tuple[list[int], list[int]]], list[tuple[list[int], list[int]]], list[bool]]:
    """The rows' examples and KL twins as (ids, labels) in batch order, and each example's label."""
    matched, twins, desirable = [], [], []
    for row in rows:
        with_twins = len(row["seq_lengths"]) == 2 * len(row["desirable"])
        start = 0
        for k, n in enumerate(row["seq_lengths"]):
            seq = (row["input_ids"][start : start + n], row["labels"][start : start + n])
            (twins if with_twins and k % 2 else matched).append(seq)
            start += n
        desirable += row["desirable"]
    return matched, twins, desirable


def _padded(seqs: list[tuple[list[int], list[int]]], pad_token_id: int) -> dict:
    """TRL's padded layout of one side: [N, L] ids, attention and completion masks, and where each scored position's
    value goes in TRL's [N, L-1] per-token tensors (`logp_index`; position p predicts token p+1)."""
    width = max(len(ids) for ids, _ in seqs)
    input_ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    for k, (ids, lab) in enumerate(seqs):
        input_ids[k, : len(ids)] = torch.tensor(ids)
        labels[k, : len(lab)] = torch.tensor(lab)
        attention[k, : len(ids)] = 1
    rows_idx, cols = (labels[:, 1:] != IGNORE).nonzero(as_tuple=True)  # row-major: the order scoring returns them in
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "completion_mask": (labels != IGNORE).long(),
        "pair_labels": labels,
        "logp_index": rows_idx * (width - 1) + cols,
    }


def _packed(seqs: list[tuple[list[int], list[int]]]) -> dict:
    """One side as one padding-free sequence for the model (per-sample attention), plus TRL's padded layout."""
    lengths = [len(ids) for ids, _ in seqs]
    batch = _padded(seqs, 0)  # never run through the model: TRL reads its masks, the model reads `packed_*`
    batch.pop("pair_labels")
    positions, varlen = bounds(lengths)
    labels = torch.tensor([t for _, lab in seqs for t in lab], dtype=torch.long)[None]
    return {
        **batch,
        "packed_input_ids": torch.tensor([t for ids, _ in seqs for t in ids], dtype=torch.long)[None],
        "packed_labels": labels,
        "packed_position_ids": positions,
        **varlen,
        **host_facts(labels, sum(lengths), varlen["cu_seq_lens_q"]),
    }


@dataclass
class PackedFeedbackCollator:
    """Rows -> the examples as one packed sequence and their KL twins as another (`KL_` keys), each with TRL's padded
    layout (`input_ids`, `attention_mask`, `completion_mask` [B, L]; `KL_input_ids`, ...), which TRL's KTO loss reads
    for its masks and counts, and `label` (desirable) per example."""

    max_length: int

    def __call__(self, rows: list[dict]) -> dict:
        return _batch(rows, _packed, self.max_length)


@dataclass
class PaddedFeedbackCollator:
    """The unpacked layout: each sequence its own padded row (the model runs on them, `pair_labels` its labels)."""

    pad_token_id: int

    def __call__(self, rows: list[dict]) -> dict:
        return _batch(rows, self._side, None)

    def _side(self, seqs: list[tuple[list[int], list[int]]]) -> dict:
        side = _padded(seqs, self.pad_token_id)
        return {**side, **host_facts(side["pair_labels"], int(side["attention_mask"].sum()))}


def _batch(rows: list[dict], side, max_length: int | None) -> dict:
    matched, twins, desirable = _sides(rows)
    batch = {**side(matched), "label": torch.tensor(desirable, dtype=torch.bool),
             "row_units": [len(row["desirable"]) for row in rows]}  # examples per row (the evaluation loss's cut, train/trainer.py)
    if twins:
        batch.update({f"KL_{k}": v for k, v in side(twins).items()})
    if max_length is None:  # padded: the slots are the padded tensors
        batch["token_slots"] = batch["input_ids"].numel() + (batch["KL_input_ids"].numel() if twins else 0)
    else:  # a row holds up to max_length tokens of examples and as many of their twins
        batch["token_slots"] = len(rows) * (2 if twins else 1) * max_length
    if "ref_logps" in rows[0]:  # precomputed reference log-probs, stored per row in example order
        batch["ref_logps"] = torch.tensor([v for row in rows for v in row["ref_logps"]])
        if twins:
            batch["ref_KL_logps"] = torch.tensor([v for row in rows for v in row["ref_KL_logps"]])
    return batch
