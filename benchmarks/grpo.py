"""GRPO throughput on a tiny ERNIE 4.5 model with the real tokenizer (103k vocabulary), on CPU: erniekit-lite's packed
completion scoring against TRL's own padded scoring, the same trainer otherwise.

Each round runs both modes, each in a fresh child process (`--child MODE`): LoRA r16 on all seven projections of a
random tiny model (hidden 128, 4 layers), beta 0.04 (a reference pass with the adapter disabled), 8 completions of up
to 64 tokens for each of 2 prompts per step (recipes/data/grpo_arith.jsonl rendered as training renders prompts),
transformers' `generate` at temperature 1, rewards exact_answer + length. `packed`: the model runs packed_sdpa and
scores each micro-batch as one packed row, the LM head at completion positions only (train/grpo_scoring.py);
`trl-padded`: TRL's `_get_per_token_logps_and_entropies` on its padded [B, P + C] batch (plain sdpa, its fused head
over every completion position of every row). Reported per mode, min / median / max over rounds:
- end to end: prompt + completion tokens of every generated sequence / wall time of `train()`;
- generation: completion tokens / time in `generate`;
- scoring + update: real tokens of the grad passes / (wall time - generation time): the scoring passes (old policy
  when needed, reference, policy) with backward and the optimizer.

    python benchmarks/grpo.py [--rounds 3] [--steps 6] [--out benchmarks/results-grpo-cpu-tiny.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common  # benchmarks/ is the script's own directory, first on sys.path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("packed", "trl-padded")


def child(mode: str, model_dir: str, steps: int, out: str) -> None:
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    from erniekit_lite import rewards
    from erniekit_lite.data.prompts import prepare_prompts
    from erniekit_lite.model.load import load_model
    from erniekit_lite.recipe import DataSection
    from erniekit_lite.train.grpo import prompts_dataset
    from erniekit_lite.train.grpo_trainer import ErnieGRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = prepare_prompts(DataSection(train=[str(ROOT / "recipes" / "data" / "grpo_arith.jsonl")], max_length=64), tokenizer, log=lambda *a: None)
    model = load_model(model_dir, attn_implementation="packed_sdpa" if mode == "packed" else "sdpa")
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=16, num_generations=8, max_completion_length=64,
                      beta=0.04, learning_rate=1e-4, max_steps=steps, logging_steps=steps, save_strategy="no", report_to="none",
                      bf16=False, seed=0, activation_checkpointing=False, disable_tqdm=True)
    trainer = ErnieGRPOTrainer(model=model, reward_funcs=[rewards.exact_answer, rewards.length], args=args,
                               train_dataset=prompts_dataset(data.train.items), processing_class=tokenizer,
                               peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=_common.LORA_TARGETS))
    trainer.packed_scoring = mode == "packed"
    spent = {"generate_s": 0.0, "generated": 0, "sequence_tokens": 0}
    inner = trainer._generate_single_turn

    def timed(prompt_ids, *a, **k):
        started = time.perf_counter()
        completions, logprobs = inner(prompt_ids, *a, **k)
        spent["generate_s"] += time.perf_counter() - started
        spent["generated"] += sum(len(c) for c in completions)
        spent["sequence_tokens"] += sum(len(p) + len(c) for p, c in zip(prompt_ids, completions))
        return completions, logprobs

    trainer._generate_single_turn = timed
    score = trainer._get_per_token_logps_and_entropies
    spent["grad_tokens"] = 0

    def counted(model, input_ids, attention_mask, *a, **k):
        import torch

        if torch.is_grad_enabled():  # the policy pass that backward runs through (old-policy / reference passes: no grad)
            spent["grad_tokens"] += int(attention_mask.sum())
        return score(model, input_ids, attention_mask, *a, **k)

    trainer._get_per_token_logps_and_entropies = counted
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    Path(out).write_text(json.dumps({
        "end_to_end": spent["sequence_tokens"] / wall,
        "generation": spent["generated"] / spent["generate_s"],
        "scoring_update": spent["grad_tokens"] / (wall - spent["generate_s"]),
        "wall_s": wall, "completion_tokens": spent["generated"], "grad_tokens": spent["grad_tokens"],
    }))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per mode and round (16 completions each)")
    p.add_argument("--shared", default=_common.DEFAULT_SHARED, help="shared reference files (the real ERNIE 4.5 tokenizer)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results-grpo-cpu-tiny.txt"))
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.model, args.steps, args.json)
        return 0
    from erniekit_lite.tiny import write_tiny

    tokenizer = Path(args.shared) / "ernie45" / "ernie-4.5-0.3b-base-pt"
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="erniekit-grpo-bench-") as tmp:
        model = write_tiny(str(Path(tmp) / "tiny"), "dense", str(tokenizer), hidden_size=128, layers=4)
        for _ in range(args.rounds):
            for mode in MODES:  # interleaved, so a busy spell on the machine touches both modes
                out = Path(tmp) / f"{mode}.json"
                subprocess.run([sys.executable, __file__, "--child", mode, "--model", str(model), "--steps", str(args.steps),
                                "--json", str(out)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "TQDM_DISABLE": "1"})
                results[mode].append(json.loads(out.read_text()))
    load.append(os.getloadavg()[0])
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.machine())
    lines = [
        "# GRPO tokens/s on CPU: tiny ERNIE 4.5 (hidden 128, 4 layers, real 103k-token vocabulary), LoRA r16, beta 0.04,",
        f"# {args.steps} steps of 16 completions (2 prompts x 8, up to 64 tokens), transformers' generate; packed = erniekit-lite, "
        "trl-padded = TRL's own scoring",
        f"machine: {os.cpu_count()} cores ({cpu}); git {_common.git_revision()}; {args.rounds} rounds, modes interleaved, each in a "
        f"fresh process; load average (1 min) before / after {load[0]:.2f} / {load[1]:.2f}",
    ]
    for metric, what in (("end_to_end", "end to end (prompt + completion tokens / train wall)"),
                         ("generation", "generation (completion tokens / generate time)"),
                         ("scoring_update", "scoring + update (grad-pass tokens / non-generation time)")):
        lines.append(f"{what}, tokens/s min / median / max:")
        for mode in MODES:
            values = [r[metric] for r in results[mode]]
            lines.append(f"  {mode:<11} {min(values):8.1f} / {statistics.median(values):8.1f} / {max(values):8.1f}")
    walls = {m: statistics.median(r["wall_s"] for r in results[m]) for m in MODES}
    lines.append("train wall seconds, median: " + ", ".join(f"{m} {walls[m]:.1f}" for m in MODES))
    lines.append(f"command: python benchmarks/grpo.py --rounds {args.rounds} --steps {args.steps}")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
