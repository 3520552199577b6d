"""Padded vs packed DPO throughput with erniekit-lite's own DPO trainer, on the same pairs, in one run.

    python benchmarks/dpo_packing.py [--steps 8] [--batch 4] [--max-length 1024] [--rounds 1] [--samples N]
                                     [--released-shape] [--threads N]

The erniekit-lite-only view of `benchmarks/dpo.py` (same code, modes erniekit-padded and erniekit-packed; see that
file and `benchmarks/_common.py` for the setup and the metric):
- Trains LoRA DPO (r16 on all seven projections, fp32, no activation checkpointing, sigmoid loss, beta 0.1; the
  reference pass is the policy with its adapter disabled) through `erniekit_lite.train.dpo.run` (`method: dpo`) on
  the first `--samples` pairs of the LLaMA-Factory DPO demo (sharegpt preference format, 300 pairs), once with
  `data.packing: false` (`PaddedPairCollator`: each sequence its own padded row) and once with `data.packing: true`
  (`PackedPairCollator`: whole pairs packed into padding-free rows of up to 2 x max_length tokens, per-sample
  attention), interleaved over `--rounds`.
- Each training run is a fresh child process, so its peak resident memory (VmHWM, read from /proc/self/status at
  exit) is that mode's alone; the baseline RSS before training is in the JSON.

How "the same work" is defined
- Headline metric: real (non-pad) tokens per second: the benchmark's own count of the tokens (chosen and rejected,
  prompt included) the training steps consumed, over the wall clock of `Trainer.train()` (erniekit-lite's own
  `train_tokens_per_second` is shown beside it). Results recorded before this harness
  (benchmarks/results-dpo_packing-*.txt) used erniekit-lite's own figure.
- Padded mode: `--batch` pairs per step (2 x batch sequences, each padded to the longest in its batch) for `--steps`.
- Packed mode: rows = max(1, round(batch * mean_pair_len / mean_row_len)) (about as many pairs per step), steps =
  max(1, round(steps * batch * mean_pair_len / (rows * mean_row_len))) (about the same real tokens). Which pairs
  each run draws is up to the Trainer's seeded shuffle, so the two budgets differ a little.

Noise: see benchmarks/sft_packing.py. Output: a markdown table (with each mode's peak RSS), the packed/padded
ratios, then ONE final JSON line.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dpo import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(packing_only=True))
