"""GPU throughput, MFU and peak memory of erniekit-lite SFT at the released ERNIE 4.5 shapes (random weights).

    python benchmarks/gpu_sft.py --model 0.3b                       # full SFT, 4k packed rows, bf16
    python benchmarks/gpu_sft.py --model 21b-a3b --layers 4 --lora 32   # MoE LoRA on 4 of 28 layers
    python benchmarks/gpu_sft.py --model 0.3b --smoke               # the same code path on CPU, tiny, no MFU

What it runs: the released config from `../shared/ernie45/<model>` (optionally with fewer layers, so the 21B MoE
fits a benchmark machine's disk and time), random weights written to a temp dir with the real tokenizer, and
`erniekit_lite.train.sft.run` on the alpaca demo packed into rows of `--row-length` (one row per step): the
product path, trainer and all. Steps after `--warmup` are timed from the run's own per-step log
(`progress.jsonl`: real tokens/s per step).

MFU = model FLOPs per real token x real tokens/s / the GPU's dense bf16 peak (`--peak-tflops`, default from the
device name: H100/H200 989, A100 312). Model FLOPs per token, the PaLM convention: 6 x the matmul parameters a
token passes through (for the MoE: the dense layer, shared experts and 6 of 64 routed experts; the LM head
included) + 6 x layers x hidden x mean sample length for causal attention (12 x ... halved), with LoRA 4 x
instead of 6 x for the frozen weights (no weight gradient) + 6 x the adapters. erniekit-lite runs the LM head
only at trained positions, so its real work per token is below this count: MFU here credits the skipped head.

Peak memory: torch.cuda.max_memory_allocated / max_memory_reserved over the run. Prints a table and one JSON line.
Not yet run on a GPU by this project (no GPU was available where it was written); `--smoke` is what was run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {"0.3b": "ernie-4.5-0.3b-base-pt", "21b-a3b": "ernie-4.5-21b-a3b-pt"}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="0.3b")
    p.add_argument("--shared", default=os.environ.get("ERNIEKIT_SHARED", str(ROOT.parent / "shared")))
    p.add_argument("--layers", type=int, default=None, help="keep only this many layers (default: all)")
    p.add_argument("--row-length", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timing (compilation, allocator)")
    p.add_argument("--lora", type=int, default=0, metavar="R", help="LoRA rank (0: full fine-tuning)")
    p.add_argument("--checkpointing", choices=["auto", "on", "off"], default="auto",
                   help="activation checkpointing; auto: erniekit-lite's choice from the memory plan")
    p.add_argument("--attn", default="auto", help="model.attn_implementation")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the GPU (default: by name)")
    p.add_argument("--smoke", action="store_true", help="CPU, 2 layers of hidden 64, fp32: checks the script runs")
    return p.parse_args(argv)


def write_model(args, tmp: Path) -> tuple[Path, object]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = Path(args.shared) / "ernie45" / MODELS[args.model]
    config = AutoConfig.from_pretrained(source)
    if args.layers:
        config.num_hidden_layers = args.layers
    if args.smoke:
        config.hidden_size, config.intermediate_size, config.num_hidden_layers = 64, 128, 2
        config.num_attention_heads, config.num_key_value_heads = 4, 2
        if hasattr(config, "moe_intermediate_size"):
            config.moe_intermediate_size = 32
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if args.smoke else torch.bfloat16)
    out = tmp / "model"
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(Path(args.shared) / "ernie45" / MODELS["0.3b"])  # 21B's is the same
    tokenizer.save_pretrained(out)
    return out, model


def flops_per_token(model, lora: int, mean_length: float) -> float:
    """PaLM-style model FLOPs per token (see the module docstring)."""
    config = model.config
    matmul, experts = 0, 0
    for name, p in model.named_parameters():
        if p.ndim < 2 or "embed_tokens" in name or ".mlp.gate." in name or "lora_" in name:
            continue
        if "mlp.experts." in name:  # fused [experts, ...] weights: a token uses k of them
            experts += p.numel()
        else:
            matmul += p.numel()
    if getattr(config, "tie_word_embeddings", False):
        matmul += model.get_input_embeddings().weight.numel()  # the head is the embedding matrix
    n_experts = getattr(config, "moe_num_experts", 0) or 0
    active = matmul + (experts * config.moe_k / n_experts if n_experts else 0)
    attention = 6 * config.num_hidden_layers * config.hidden_size * mean_length
    if not lora:
        return 6 * active + attention
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    return 4 * active + attention + 6 * adapters


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from erniekit_lite.recipe import from_dict
    from erniekit_lite.train.sft import run

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("no CUDA GPU: run with --smoke to check the script on CPU", file=sys.stderr)
        return 2
    data = Path(args.shared) / "data" / "llamafactory" / "alpaca_en_demo.json"
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
    with tempfile.TemporaryDirectory(prefix="erniekit-gpu-bench-") as tmp:
        tmp = Path(tmp)
        model_dir, model = write_model(args, tmp)
        train = {
            "max_steps": args.steps,
            "per_device_train_batch_size": 1,
            "logging_steps": 1,
            "save_strategy": "no",
            "report_to": "none",
            "learning_rate": 1e-5,
            "bf16": cuda,
            "disable_tqdm": True,
            "seed": 0,
        }
        if args.checkpointing != "auto":
            train["activation_checkpointing"] = args.checkpointing == "on"
        recipe = from_dict({
            "model": {"path": str(model_dir), "dtype": "float32", "attn_implementation": args.attn},
            "data": {"train": [{"path": str(data), "format": "alpaca"}], "max_length": args.row_length, "packing": True},
            **({"lora": {"r": args.lora, "alpha": 2 * args.lora}} if args.lora else {}),
            "train": train,
            "output": {"dir": str(tmp / "run")},
        }, source="benchmarks/gpu_sft.py")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        lines: list[str] = []
        started = time.perf_counter()
        out = run(recipe, log=lines.append)
        wall = time.perf_counter() - started
        logs = [json.loads(x) for x in (out / "progress.jsonl").read_text().splitlines()]
        rates = [e["tokens_per_second"] for e in logs if e["event"] == "log" and "tokens_per_second" in e]
        timed = rates[args.warmup:] or rates
        results = json.loads((out / "train_results.json").read_text())
        from transformers import AutoTokenizer

        from erniekit_lite.data.prepare import prepare

        prepared = prepare(recipe.data, AutoTokenizer.from_pretrained(model_dir), log=lambda *a: None)
        mean_length = statistics.mean(prepared.train.stats.lengths)
        if args.lora:
            from erniekit_lite.model.lora import apply_lora

            model = apply_lora(model, recipe.lora)
        per_token = flops_per_token(model, args.lora, mean_length)
        tokens_per_second = statistics.median(timed)
        mfu = per_token * tokens_per_second / (peak * 1e12) if (peak and cuda) else None
        memory = {
            "max_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "max_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
        }
        checkpointing = next((x for x in lines if x.startswith("activation checkpointing")), None)

    layers = args.layers or "all"
    what = f"{'LoRA r%d' % args.lora if args.lora else 'full SFT'}, {args.model} shape ({layers} layers), rows of {args.row_length}"
    print(f"# {what}; {device}; torch {torch.__version__}; {args.steps} steps, first {args.warmup} untimed")
    print("| real tokens/s (median step) | model GFLOPs/token | MFU | peak allocated GiB | peak reserved GiB | packing efficiency |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {tokens_per_second:.0f} | {per_token / 1e9:.2f} | {'%.1f%%' % (100 * mfu) if mfu is not None else 'n/a'} | "
          f"{memory['max_allocated_gib']} | {memory['max_reserved_gib']} | {results['packing_efficiency']:.1%} |")
    if checkpointing:
        print(checkpointing)
    print(json.dumps({
        "benchmark": "gpu_sft", "model": args.model, "layers": layers, "lora": args.lora, "row_length": args.row_length,
        "device": device, "torch": torch.__version__, "steps": args.steps, "warmup": args.warmup,
        "tokens_per_second_median": round(tokens_per_second, 1), "per_step_tokens_per_second": rates,
        "flops_per_token": per_token, "peak_tflops": peak, "mfu": round(mfu, 4) if mfu is not None else None,
        **memory, "packing_efficiency": results["packing_efficiency"], "train_loss": results["train_loss"],
        "wall_seconds": round(wall, 1), "checkpointing": checkpointing,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
