"""Batches for the model: padding-free packed rows, or padded rows with an attention mask.

Packed: the rows of a batch are flattened into one sequence of shape [1, T] with restarting `position_ids`
and `cu_seq_lens_q/k`, the boundaries transformers' varlen attention kernels read (flash attention, and our
per-sample sdpa on CPU). No `attention_mask`: with one, the kernels would treat the row as a single sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from erniekit_lite.data.tokenize import IGNORE


def bounds(lengths: list[int], device=None) -> tuple[torch.Tensor, dict]:
    """Sequences of these lengths laid end to end: their restarting `position_ids` [1, T], and the per-sample bounds
    varlen attention reads (`cu_seq_lens_q/k`, `max_length_q/k`)."""
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.tensor(lengths, device=device).cumsum(0)
    longest = max(lengths)
    return positions, {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def labelled_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [batch, seq] mask of the positions whose next token is trained, and those tokens (flat, row-major)."""
    targets = labels[:, 1:]
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = targets != IGNORE
    return keep, targets[keep[:, :-1]]


def host_facts(labels: torch.Tensor, real_tokens: int, cu: torch.Tensor | None = None) -> dict:
    """What the training step would otherwise read back from the GPU (a wait for the device each), known here on the
    CPU: the flat positions whose next token is trained and those tokens (the LM head selects them by index, not by a
    boolean mask whose size is a host read: `scoring.score`), the real tokens (the throughput count) and, for packed
    rows, the sample lengths per-sample attention cuts the row at (`attention.remember_lengths`)."""
    keep, targets = labelled_positions(labels)
    facts = {"score_positions": keep.flatten().nonzero().squeeze(1), "score_targets": targets, "real_tokens": real_tokens}
    if cu is not None:
        facts["sample_lengths"] = (cu[1:] - cu[:-1]).tolist()
    return facts


@dataclass
class PackedCollator:
    max_length: int  # row capacity, for the packing-efficiency count

    def __call__(self, rows: list[dict]) -> dict:
        lengths = [n for row in rows for n in row["seq_lengths"]]
        input_ids = torch.tensor([t for row in rows for t in row["input_ids"]], dtype=torch.long)[None]
        labels = torch.tensor([t for row in rows for t in row["labels"]], dtype=torch.long)[None]
        position_ids, varlen = bounds(lengths)
        return {
            "input_ids": input_ids,
            "labels": labels,
            "position_ids": position_ids,
            **varlen,
            "token_slots": len(rows) * self.max_length,
            **host_facts(labels, input_ids.numel(), varlen["cu_seq_lens_q"]),
        }


@dataclass
class PaddedCollator:
    pad_token_id: int

    def __call__(self, rows: list[dict]) -> dict:
        width = max(len(row["input_ids"]) for row in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            input_ids[i, :n] = torch.tensor(row["input_ids"])
            labels[i, :n] = torch.tensor(row["labels"])
            attention_mask[i, :n] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask, "token_slots": input_ids.numel(),
                **host_facts(labels, int(attention_mask.sum()))}
