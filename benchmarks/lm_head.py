"""The LM-head step alone: erniekit-lite's scoring (`scoring._chunk_scores`) vs log_softmax + gather.

    python benchmarks/lm_head.py [--tokens 1024] [--hidden 256] [--vocab 103424] [--repeats 5]

Forward and backward of the loss -mean(log p(target)) from hidden states through a frozen LM head (LoRA
training: only the hidden states need a gradient), as one chunk. Both ways run interleaved in one process on
the same tensors; the gradients are checked equal. This is most of a training step of a small ERNIE model,
whose 103k-row head dwarfs the layers. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def reference(hidden, head, targets):
    logits = head(hidden).float()
    log_probs = torch.log_softmax(logits, -1)
    token = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    with torch.no_grad():
        top1 = logits.argmax(-1) == targets
    return token, top1


def ours(hidden, head, targets):
    token, _, _, _, top1 = _chunk_scores(hidden, head, targets, False)
    return token, top1


def step(fn, hidden, head, targets):
    h = hidden.detach().requires_grad_()
    token, _ = fn(h, head, targets)
    (-token.mean()).backward()
    return h.grad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=103424)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False).requires_grad_(False)
    hidden = torch.randn(args.tokens, args.hidden)
    targets = torch.randint(0, args.vocab, (args.tokens,))
    load = os.getloadavg()[0]
    g_ref, g_ours = step(reference, hidden, head, targets), step(ours, hidden, head, targets)
    max_diff = (g_ref - g_ours).abs().max().item()
    times = {"log_softmax + gather": [], "erniekit-lite": []}
    for _ in range(args.repeats):
        for name, fn in (("log_softmax + gather", reference), ("erniekit-lite", ours)):
            t = time.perf_counter()
            step(fn, hidden, head, targets)
            times[name].append(time.perf_counter() - t)
    spread = {k: (min(v), statistics.median(v), max(v)) for k, v in times.items()}
    ratio = spread["log_softmax + gather"][1] / spread["erniekit-lite"][1]
    print(f"# LM-head step, {args.tokens} tokens x hidden {args.hidden} x vocab {args.vocab}, fp32, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load average {load:.2f}")
    print(f"| way | ms, min / median / max of {args.repeats} | tokens/s (median) |")
    print("| --- | ---: | ---: |")
    for k, (lo, mid, hi) in spread.items():
        print(f"| {k} | {lo * 1000:.0f} / **{mid * 1000:.0f}** / {hi * 1000:.0f} | {args.tokens / mid:.0f} |")
    print(f"speed-up (medians) {ratio:.2f}x; max |grad difference| {max_diff:.2e}")
    print(json.dumps({"benchmark": "lm_head", "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
                      "ms": {k: [round(x * 1000, 1) for x in v] for k, v in spread.items()}, "speedup_of_medians": round(ratio, 3),
                      "max_grad_diff": max_diff, "threads": torch.get_num_threads(), "loadavg": round(load, 2)}))
    return 0


import torch  # noqa: E402

from erniekit_lite.train.scoring import _chunk_scores  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
