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
          steps: int = 12, lora_r: int = 16):
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
        bf16=False,
        gradient_checkpointing=False,
        padding_free=mode == "padding_free",
        packing=mode == "bfd",
        packing_strategy="bfd",
        report_to="none",
        logging_steps=steps,  # one log, at the last step (TRL's own num_tokens)
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    peft_config = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules=LORA_TARGETS,
                             task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=config, train_dataset=alpaca_dataset(data_path), processing_class=tokenizer,
                         peft_config=peft_config)
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


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("data_path")
    ap.add_argument("out_dir")
    ap.add_argument("--mode", choices=["padded", "padding_free", "bfd"], default="padded")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    print(train(a.model_dir, a.data_path, a.out_dir, a.mode, a.max_length, a.batch, a.steps).state.log_history[-1])
