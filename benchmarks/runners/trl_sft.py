"""A plain TRL SFT script, what a user would write (main venv): SFTTrainer on alpaca as prompt/completion.

    python benchmarks/runners/trl_sft.py MODEL_DIR ALPACA.json OUT_DIR --mode padded|padding_free|bfd

- The model and tokenizer come from MODEL_DIR (`from_pretrained`, fp32, sdpa); the tokenizer's ERNIE 4.5 chat
  template renders the conversation (TRL's conversational prompt/completion format, so only the completion is
  trained: TRL's default `completion_only_loss`).
- LoRA r16 (alpha 32) on the seven projections through `peft_config`.
- `SFTConfig(max_length=1024, per_device_train_batch_size=8, max_steps=12, bf16=False, ...)` and per mode:
  padded (TRL's default collator pads each batch to its longest sample); `padding_free=True` (the batch's samples
  concatenated into one [1, T] row; TRL requires `max_length=None` without packing, so samples are not cut: every
  alpaca sample is shorter than 1024 tokens anyway); `packing=True, packing_strategy="bfd"` (best-fit-decreasing
  rows of up to max_length, padding-free; the batch is 8 such rows).
- Two departures from TRL's defaults, for the same work as the other modes: `gradient_checkpointing=False` (TRL
  defaults to True; no mode here checkpoints) and learning rate 1e-4 (TRL: 2e-5; no effect on speed).

`benchmarks/gpu_check.py` (section 10) runs it on a GPU as `--bf16 --lora-r 0 --result FILE`: full fine-tuning in
bf16 mixed precision (fp32 weights, TRL's default dtype), gradient checkpointing as erniekit-lite's run chose, a log
every step; FILE gets the median step's tokens/s (TRL's `num_tokens` per step over the step's wall time) after
`--warmup` steps.
"""

from __future__ import annotations

import argparse
import json

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def alpaca_dataset(path: str):
    from datasets import Dataset

    rows = []
    for r in json.loads(open(path, encoding="utf-8").read()):
        user = f"{r['instruction']}\n{r['input']}" if r.get("input") else r["instruction"]
        rows.append({"prompt": [{"role": "user", "content": user}],
                     "completion": [{"role": "assistant", "content": r["output"]}]})
    return Dataset.from_list(rows)


def train(model_dir: str, data_path: str, out_dir: str, mode: str = "padded", max_length: int = 1024, batch: int = 8,
          steps: int = 12, lora_r: int = 16, bf16: bool = False, gradient_checkpointing: bool = False,
          logging_steps: int | None = None, callbacks=()):
    """`lora_r` 0: full fine-tuning."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    config = SFTConfig(
        output_dir=out_dir,
        max_length=None if mode == "padding_free" else max_length,
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=1e-4,
        bf16=bf16,
        gradient_checkpointing=gradient_checkpointing,
        padding_free=mode == "padding_free",
        packing=mode == "bfd",
        packing_strategy="bfd",
        report_to="none",
        logging_steps=logging_steps or steps,  # by default one log, at the last step (TRL's own num_tokens)
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    peft_config = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules=LORA_TARGETS,
                             task_type="CAUSAL_LM") if lora_r else None
    trainer = SFTTrainer(model=model, args=config, train_dataset=alpaca_dataset(data_path), processing_class=tokenizer,
                         peft_config=peft_config, callbacks=list(callbacks))
    trainer.train()
    return trainer


def run(p: dict, probe) -> dict:
    """Benchmark entry (benchmarks/_common.py): the probe times and counts; TRL's own num_tokens is reported."""
    trainer = train(p["model_dir"], p["data_path"], p["out_dir"], p["mode"], p["max_length"], p["batch"], p["steps"],
                    p["lora_r"])
    return {"reported": trl_reported(trainer, probe), "notes": []}


def trl_reported(trainer, probe) -> dict:
    """TRL's own token count (`num_tokens`: attention_mask sums, or row widths when padding-free) over the
    Trainer's train_runtime."""
    logged = [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]
    runtime = (probe.output.metrics or {}).get("train_runtime")
    return {"TRL num_tokens/train_runtime": round(logged[-1] / runtime, 2)} if logged and runtime else {}


def step_rates(trainer, clock: list[float], warmup: int) -> dict:
    """Per optimizer step after `warmup`: TRL's `num_tokens` added (logged every step) over the step's wall time
    (`clock`: the time each step ended, from StepClock); the median, as gpu_check rates erniekit-lite's steps."""
    import statistics

    tokens = [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]
    rates = [(tokens[i] - tokens[i - 1]) / (clock[i] - clock[i - 1]) for i in range(max(1, warmup), min(len(tokens), len(clock)))]
    return {"tokens_per_second": statistics.median(rates) if rates else None, "steps_timed": len(rates),
            "tokens_per_step": (tokens[-1] - tokens[0]) / max(1, len(tokens) - 1) if tokens else None,
            "train_loss": trainer.state.log_history[-1].get("train_loss")}


def step_clock(clock: list[float]):
    import time

    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.append(time.perf_counter())

    return StepClock()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("data_path")
    ap.add_argument("out_dir")
    ap.add_argument("--mode", choices=["padded", "padding_free", "bfd"], default="padded")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--lora-r", type=int, default=16, help="0: full fine-tuning")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--result", help="write the median step's tokens/s after --warmup steps here (JSON); logs every step")
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    clock: list[float] = []
    trainer = train(a.model_dir, a.data_path, a.out_dir, a.mode, a.max_length, a.batch, a.steps, a.lora_r, a.bf16,
                    a.gradient_checkpointing, logging_steps=1 if a.result else None, callbacks=[step_clock(clock)])
    if a.result:
        weights = next(trainer.model.parameters())
        result = {**step_rates(trainer, clock, a.warmup), "dtype": str(weights.dtype), "device": str(weights.device),
                  "attn_implementation": trainer.model.config._attn_implementation, "padding_free": trainer.padding_free}
        open(a.result, "w").write(json.dumps(result))
    print(trainer.state.log_history[-1])
