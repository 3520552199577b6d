"""A plain TRL DPO script, what a user would write (main venv): DPOTrainer on the sharegpt DPO demo.

    python benchmarks/runners/trl_dpo.py MODEL_DIR DPO.json OUT_DIR

- The sharegpt records (`conversations` with human/gpt/system turns, `chosen` / `rejected` gpt messages) become
  TRL's conversational preference format (prompt messages, chosen / rejected assistant messages); the tokenizer's
  ERNIE 4.5 chat template renders them.
- The model from MODEL_DIR (fp32, sdpa); LoRA r16 (alpha 32) on the seven projections through `peft_config`, so
  TRL's reference pass is the base with the adapter disabled (as in erniekit-lite and LLaMA-Factory).
- `DPOConfig(max_length=1024, per_device_train_batch_size=4, max_steps=12, bf16=False, ...)`, sigmoid loss, beta
  0.1 (TRL's defaults). TRL cuts each prompt+response sequence to max_length (keep_start) in its collator; a
  prompt longer than that leaves no response tokens, and TRL trains on the pair anyway (erniekit-lite skips it).
- Departures from TRL's defaults, for the same work as the other modes: `gradient_checkpointing=False` and
  learning rate 1e-4 (TRL: 1e-6; no effect on speed).
"""

from __future__ import annotations

import argparse
import json

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def preference_dataset(path: str):
    from datasets import Dataset

    rows = []
    for r in json.loads(open(path, encoding="utf-8").read()):
        prompt = [{"role": ROLES[m["from"]], "content": m["value"]} for m in r["conversations"]]
        rows.append({"prompt": prompt,
                     "chosen": [{"role": "assistant", "content": r["chosen"]["value"]}],
                     "rejected": [{"role": "assistant", "content": r["rejected"]["value"]}]})
    return Dataset.from_list(rows)


def train(model_dir: str, data_path: str, out_dir: str, max_length: int = 1024, batch: int = 4, steps: int = 12,
          lora_r: int = 16, beta: float = 0.1, loss_type: str = "sigmoid"):
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    config = DPOConfig(
        output_dir=out_dir,
        max_length=max_length,
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=1e-4,
        beta=beta,
        loss_type=[loss_type],
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        logging_steps=steps,  # one log, at the last step (run-mean rewards/*, TRL's own num_tokens)
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    peft_config = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules=LORA_TARGETS,
                             task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=model, args=config, train_dataset=preference_dataset(data_path), processing_class=tokenizer,
                         peft_config=peft_config)
    trainer.train()
    return trainer


def run(p: dict, probe) -> dict:
    """Benchmark entry (benchmarks/_common.py): the probe times and counts; TRL's own num_tokens is reported."""
    trainer = train(p["model_dir"], p["data_path"], p["out_dir"], p["max_length"], p["batch"], p["steps"], p["lora_r"],
                    p["beta"], p["loss_type"])
    logged = [h for h in trainer.state.log_history if "num_tokens" in h]
    runtime = (probe.output.metrics or {}).get("train_runtime")
    extra = {"reported": {"TRL num_tokens/train_runtime": round(logged[-1]["num_tokens"] / runtime, 2)} if logged and runtime else {},
             "notes": []}
    rewards = [h for h in trainer.state.log_history if "rewards/accuracies" in h]
    for key in ("rewards/accuracies", "rewards/margins"):
        if rewards and key in rewards[-1]:
            extra[key] = rewards[-1][key]
    return extra


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("data_path")
    ap.add_argument("out_dir")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    print(train(a.model_dir, a.data_path, a.out_dir, a.max_length, a.batch, a.steps).state.log_history[-1])
