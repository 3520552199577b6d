"""bf16 autocast against fp32 on this CPU: 3 SFT steps of one 512-token packed row on tiny dense models (the
quick start's `tiny`, and one of hidden size 256 with 4 layers; the quick start's data, LoRA off), each precision in
its own `erniekit-lite train`, `train_results.json`'s runtime and
real tokens/s; min / median / max over the rounds, and whether the CPU has bf16 instructions (run_plan.cpu_has_bf16:
AVX512-BF16 or AMX on x86), which decides `validate`'s and `train`'s note.

    python benchmarks/cpu_bf16.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from erniekit_lite.run_plan import cpu_has_bf16  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    sizes = {"tiny (quick start)": [], "hidden 256, 4 layers": ["--hidden-size", "256", "--layers", "4"]}
    print(f"# bf16 autocast vs fp32 on this CPU: 3 SFT steps, one 512-token packed row each, full fine-tuning; "
          f"bf16 instructions: {'yes' if cpu_has_bf16() else 'no (AVX2 at most)'}")
    for size, tiny in sizes.items():
        runs: dict[str, list[dict]] = {"fp32": [], "bf16 autocast": []}
        with tempfile.TemporaryDirectory(prefix="erniekit-cpu-bf16-") as tmp:
            subprocess.run([sys.executable, "-m", "erniekit_lite", "tiny", f"{tmp}/tiny", "--arch", "dense", *tiny], check=True,
                           stdout=subprocess.DEVNULL)
            for i in range(args.rounds):
                for name, bf16 in (("fp32", "false"), ("bf16 autocast", "true")):
                    out = f"{tmp}/run-{i}-{bf16}"
                    subprocess.run([sys.executable, "-m", "erniekit_lite", "train", str(ROOT / "recipes" / "quickstart.yaml"),
                                    f"model.path={tmp}/tiny", f"output.dir={out}", f"train.bf16={bf16}", "train.max_steps=3",
                                    "data.max_length=512", "train.per_device_train_batch_size=1", "train.save_strategy=no",
                                    "train.logging_steps=1", "train.activation_checkpointing=false"],
                                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   env={**os.environ, "TQDM_DISABLE": "1"})
                    runs[name].append(json.loads(Path(out, "train_results.json").read_text()))
        medians = {}
        for name, results in runs.items():
            seconds = [r["train_runtime"] for r in results]
            speed = [r["train_tokens_per_second"] for r in results]
            medians[name] = statistics.median(seconds)
            print(f"{size}, {name}: seconds min {min(seconds):.1f} / median {medians[name]:.1f} / max {max(seconds):.1f}; "
                  f"real tokens/s median {statistics.median(speed):.0f}")
        print(f"{size}: bf16 autocast / fp32, median seconds: {medians['bf16 autocast'] / medians['fp32']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
