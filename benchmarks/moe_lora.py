"""LoRA SFT on the ERNIE-4.5-21B-A3B MoE widths: routed-expert adapters `split` vs `merged`, per MoE layer (issue 31, item 4).

    python benchmarks/moe_lora.py [--rounds 3] [--steps 2] [--warmup 1] [--length 1024] [--lora-r 8] [--vocab 1024]
                                  [--modes merged,split] [--four-bit [--four-bit-rounds 1]] [--lf [--lf-python PATH]] [--threads N]

What runs
- Random-weight ERNIE 4.5 MoE models at the released 21B-A3B widths (config `ernie45/ernie-4.5-21b-a3b-pt` under
  --shared: 64 routed experts top-6, 2 shared experts, hidden 2560, moe_intermediate 1536, dense intermediate 12288),
  vocabulary cut to --vocab (1024, so the LM head does not dominate), fp32, built as tests/test_expert_lora.py's
  `released_moe` does (`from_config`, seed 0), cut to 1 dense + 1 MoE layer ("L1") and 1 dense + 2 MoE layers ("L2").
  The cost of ONE MoE layer is the difference L2 - L1 (the embedding, the dense layer, the LM head and the loss cancel).
- LoRA through `erniekit_lite.model.lora.apply_lora` with `LoraSection(r=8, alpha=16, expert_compute=MODE)`: rank 8 on
  every default target (q/k/v/o, gate/up/down of the dense MLP and of the shared experts) AND on the fused routed
  experts (one rank-8 adapter per expert, `routed_experts: true`); the router gets none.
  - merged: peft's own ParamWrapper path, W + s·B·A formed for all 64 experts in every forward;
  - split: erniekit-lite's per-expert path (`erniekit_lite/model/expert_lora.py`), x·Wᵀ + s·(x·Aᵀ)·Bᵀ grouped over experts.
- One packed row of --length (1024) random token ids per step (4 samples of random lengths, the packed collator's
  `position_ids` + `cu_seq_lens_q/k`, attention `packed_sdpa` as erniekit-lite trains packed rows on CPU), labels =
  inputs; padding-free, so every token is real. `freeze_router_statistics` as `load_model` does.
- A plain loop: --warmup untimed optimizer step(s), then --steps timed steps (forward, backward, AdamW lr 1e-4 over the
  adapters, zero_grad), each timed with a wall clock. No Trainer: its setup, logging and dataloader are the same in
  both modes and would only add noise to a difference of two ~30 s figures.
- Every (model, mode) runs in its own child process (this script with --child SPEC), interleaved over --rounds
  (L1-merged, L1-split, L2-merged, L2-split, then again), so peaks do not mix and drift spreads over all four.

Metrics
- seconds per step: the mean of a configuration's timed steps over all rounds.
- per MoE layer: seconds = step(L2) - step(L1); real tokens/s per MoE layer = tokens per step / that. Computed from the
  round means and per round (the per-round spread is shown).
- peak RSS: VmHWM of the child process (from /proc/self/status, as benchmarks/_common.py reads it; ru_maxrss is not
  used, Linux folds the parent's mark into a child's); per MoE layer = peak(L2) - peak(L1).
- --four-bit: also runs `split` with the routed experts in 4-bit (`model.load_in_4bit`): the parent saves each random
  model once (fp32 safetensors, in the temp dir) and the child loads it through `erniekit_lite.model.load.load_model(...,
  load_in_4bit=True)` (bitsandbytes quantizes the other Linear layers too: this row is QLoRA). It records what loading
  held at most (RssAnon, sampled every 5 ms: the memory-mapped checkpoint's pages are not counted) next to the size
  of the checkpoint it read, the 4-bit experts' bytes (packed weights and statistics) against the same weights in
  bf16, and one training step without warm-up, in --four-bit-rounds rounds (default 1): on CPU bitsandbytes'
  Linear4bit runs its plain-code gemm (its fast CPU kernel comes from the Hub), minutes per step, a figure that says
  nothing of a GPU's. If loading left no experts module in NF4 the row reads "4-bit experts: not available".

Targets (issue 31): split >= 1.5x merged real tokens/s per MoE layer, at no more peak memory (peak RSS of split <= merged,
for L1 and L2 alike).

- --lf (LLaMA-Factory's own venv: --lf-python, default $LLAMAFACTORY_PYTHON or ../lf-venv/bin/python, built by
  benchmarks/install_llamafactory.sh): also LLaMA-Factory's LoRA SFT on the
  same saved model (fp32 safetensors, the real tokenizer beside it) and the same packed row, through
  `runners/llamafactory.py --moe-spec` in that venv: its training entry (`run_exp`) with its default `lora_target: all`,
  rank --lora-r (alpha 2r), the row as a pre-tokenized dataset with each token's sample number as attention_mask, which
  its `neat_packing` turns into a block-diagonal mask (it keeps one position count across the row); batch 1, fp32, sdpa,
  no gradient checkpointing, AdamW lr 1e-4 constant; a callback times each optimizer step as the loop above does. NOT
  the same work: `all` adapts every nn.Linear, and the fused routed experts are parameters, not Linear layers, so
  LLaMA-Factory trains no routed-expert adapter (the row lists what it adapted and its trainable parameters); its own
  transformers/peft versions (header).

Noise: a shared 2-core machine; the 1-minute load average before and after is printed; trust only runs that started
near the number of cores in use by nothing else. `--threads 1` is steadier on a busy machine.

Output: per-child lines, a markdown table per configuration, a markdown table per MoE layer, the target lines, then ONE
final JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (
    DEFAULT_LF_PYTHON,
    DEFAULT_SHARED,
    _status_kib,
    describe_header,
    error_line,
    git_revision,
    load_note,
    machine,
    peak_rss_mib,
    versions,
    write_tokenizer,
)

CONFIG = Path("ernie45") / "ernie-4.5-21b-a3b-pt"
MODELS = {"L1": 1, "L2": 2}  # MoE layers after the one dense layer
NOT_AVAILABLE = "4-bit experts: not available at this commit"


# ---------------------------------------------------------------- child side


def build(spec: dict):
    import torch
    from transformers import AutoModelForCausalLM

    import erniekit_lite.model.attention  # noqa: F401  registers packed_sdpa
    from erniekit_lite.model.attention import NAME

    if spec.get("model_dir"):  # --four-bit: the saved random model through the real loading path
        from erniekit_lite.model.load import load_model

        return load_model(spec["model_dir"], dtype="float32", attn_implementation=NAME, load_in_4bit=True)
    from erniekit_lite.model.load import freeze_router_statistics

    config = config_for(spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=NAME)
    freeze_router_statistics(model)
    model.config.use_cache = False
    return model


def config_for(spec: dict):
    from transformers import Ernie4_5_MoeConfig

    config = Ernie4_5_MoeConfig.from_pretrained(Path(spec["shared"]) / CONFIG)
    moe = spec["moe_layers"]
    config.update({"vocab_size": spec["vocab"], "num_hidden_layers": 1 + moe, "moe_layer_end_index": moe, "use_cache": False})
    return config


def packed_row(length: int, vocab: int, seed: int = 0) -> dict:
    """One packed row of 4 random samples (random lengths summing to `length`), as erniekit-lite's packed collator
    lays it out: [1, T] ids, per-sample position_ids, cu_seq_lens for the packed attention."""
    import torch

    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(length - 1, generator=g)[:3].add(1).tolist())
    bounds = [0, *cuts, length]
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    ids = torch.randint(0, vocab, (1, length), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = torch.tensor(bounds, dtype=torch.int32)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": max(lengths), "max_length_k": max(lengths)}


class AnonPeak:
    """The largest RssAnon (anonymous memory: what the process itself allocated, not the checkpoint's memory-mapped
    pages, which VmHWM also counts) seen while active, sampled every 5 ms by a thread."""

    def __enter__(self):
        import threading

        self.peak, self.done = _status_kib("RssAnon") or 0, threading.Event()

        def sample():
            while not self.done.wait(0.005):
                self.peak = max(self.peak, _status_kib("RssAnon") or 0)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, _status_kib("RssAnon") or 0)


def child(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    from benchmarks._common import quiet_transformers

    quiet_transformers()
    from erniekit_lite.model import expert_4bit
    from erniekit_lite.model.lora import apply_lora
    from erniekit_lite.recipe import LoraSection

    baseline = _status_kib("VmRSS")
    t0 = time.perf_counter()
    with AnonPeak() as loading:
        model = build(spec)
    four_bit = sum(1 for m in model.modules() if expert_4bit.is_4bit(m))
    result = {"experts_4bit_modules": four_bit, "load_peak_anon_mib": round(loading.peak / 1024, 1)}
    if spec.get("model_dir"):  # what loading in 4-bit held at most, next to the checkpoint it read
        result["checkpoint_mib"] = round(sum(f.stat().st_size for f in Path(spec["model_dir"]).glob("*.safetensors")) / 2**20, 1)
    stacks = [m for m in model.modules() if expert_4bit.is_4bit(m)]
    if stacks:  # the 4-bit experts' bytes (packed weights and statistics) against the same weights in bf16
        result["experts_4bit_bytes"] = sum(expert_4bit.stack_bytes(m) for m in stacks)
        result["experts_bf16_bytes"] = sum(2 * getattr(m, n).numel() * 2 for m in stacks for n in m.nf4_shapes)
    if spec.get("model_dir") and not four_bit:
        result.update({"unavailable": NOT_AVAILABLE, "build_seconds": round(time.perf_counter() - t0, 1)})
        result["peak_rss_mib"], _ = peak_rss_mib()
        Path(spec["result"]).write_text(json.dumps(result))
        return 0
    model = apply_lora(model, LoraSection(r=spec["lora_r"], alpha=2 * spec["lora_r"], expert_compute=spec["compute"]))
    model.train()
    from erniekit_lite.model.expert_lora import SplitExperts

    result["split_modules"] = sum(1 for m in model.modules() if type(m) is SplitExperts)
    result["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    result["build_seconds"] = round(time.perf_counter() - t0, 1)
    result["model_rss_mib"] = round((_status_kib("VmRSS") or 0) / 1024, 1)
    if not spec["warmup"] + spec["steps"]:  # --four-bit-steps 0: loading and bytes only
        result["peak_rss_mib"], result["peak_rss_source"] = peak_rss_mib()
        Path(spec["result"]).write_text(json.dumps({**result, "load_only": True}))
        return 0
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    batch = packed_row(spec["length"], spec["vocab"])
    times, losses = [], []
    for step in range(spec["warmup"] + spec["steps"]):
        t = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t
        losses.append(round(float(loss), 4))
        if step >= spec["warmup"]:
            times.append(round(seconds, 3))
        else:
            result["warmup_seconds"] = round(seconds, 3)
    result.update({"step_seconds": times, "losses": losses, "tokens_per_step": int(batch["input_ids"].numel()),
                   "threads": torch.get_num_threads()})
    result["peak_rss_mib"], result["peak_rss_source"] = peak_rss_mib()
    result["baseline_rss_mib"] = round(baseline / 1024, 1) if baseline else None
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------- parent side


def run_child(spec: dict, tmp: Path, name: str, args, command: list[str] | None = None) -> dict:
    """One child process on `spec` (this script's --child, or `command` + the spec's path); its result or {"error"}."""
    spec_path, result = tmp / f"{name}.spec.json", tmp / f"{name}.result.json"
    result.unlink(missing_ok=True)
    spec = {**spec, "result": str(result)}
    spec_path.write_text(json.dumps(spec))
    command = [*(command or [sys.executable, str(Path(__file__).resolve()), "--child"]), str(spec_path)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore" if not args.verbose else os.environ.get("PYTHONWARNINGS", ""))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(command, env=env,
                              stdout=None if args.verbose else subprocess.PIPE,
                              stderr=None if args.verbose else subprocess.STDOUT, text=True, timeout=args.timeout, check=False)
        output, code = proc.stdout or "", proc.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        code = f"timeout after {args.timeout} s"
    wall = round(time.perf_counter() - t0, 1)
    if code != 0 or not result.is_file():
        if not args.verbose:
            print(f"--- {name}: last lines of the failed child's output\n" + "\n".join(output.splitlines()[-25:]) + "\n---",
                  file=sys.stderr, flush=True)
        why = f"killed by signal {-code}{' (out of memory?)' if code == -9 else ''}" if isinstance(code, int) and code < 0 else f"exit {code}"
        return {"error": f"{why}: {error_line(output)}", "child_wall_seconds": wall}
    r = json.loads(result.read_text())
    r["child_wall_seconds"] = wall
    return r


def save_model(spec: dict, path: Path) -> str:
    """--four-bit: the random model of `spec` saved once (fp32 safetensors) so load_model can load it in 4-bit."""
    import torch
    from transformers import AutoModelForCausalLM

    if not path.is_dir():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config_for(spec), dtype=torch.float32)
        model.save_pretrained(path)
        del model
    return str(path)


def run_lf(spec: dict, model_dir: str, tmp: Path, name: str, args) -> dict:
    """The LLaMA-Factory row: the saved model with the real tokenizer beside it, the packed row every other row trains
    on (ids and each token's sample number), runners/llamafactory.py --moe-spec in LLaMA-Factory's venv."""
    import shutil

    if not (Path(model_dir) / "tokenizer_config.json").exists():
        write_tokenizer(args.shared, Path(model_dir))
    batch = packed_row(spec["length"], spec["vocab"])
    segments = [i + 1 for i, n in enumerate(batch["cu_seq_lens_q"].diff().tolist()) for _ in range(n)]
    out = tmp / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    lf_spec = {**spec, "model_dir": model_dir, "out_dir": str(out),
               "row": {"input_ids": batch["input_ids"][0].tolist(), "segments": segments}}
    r = run_child(lf_spec, tmp, name, args, command=[args.lf_python, str(Path(__file__).resolve().parent / "runners" / "llamafactory.py"),
                                                     "--moe-spec"])
    shutil.rmtree(out, ignore_errors=True)
    if "error" not in r:  # what the summary reads from every row
        r.update(split_modules=0, experts_4bit_modules=0, model_rss_mib=None)
    return r


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--shared", default=DEFAULT_SHARED, help="shared reference files (default: $ERNIEKIT_SHARED or ../shared)")
    p.add_argument("--rounds", type=int, default=3, help="passes over the configurations, interleaved")
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps per child (after --warmup)")
    p.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps first")
    p.add_argument("--length", type=int, default=1024, help="tokens in the one packed row per step")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank (alpha = 2r) on every target, routed experts included")
    p.add_argument("--modes", default="merged,split", help="comma-separated subset of: merged, split")
    p.add_argument("--four-bit", action="store_true", help="also split with 4-bit experts (model.load_in_4bit), see above")
    p.add_argument("--four-bit-steps", type=int, default=1, help="timed steps of the 4-bit rows, no warm-up (0: loading and bytes only)")
    p.add_argument("--four-bit-rounds", type=int, default=1, help="rounds of the 4-bit rows, each one untimed-warm-up-free step "
                   "(on CPU bitsandbytes' Linear4bit runs its plain-code gemm: minutes per step, a figure that says nothing of a GPU's)")
    p.add_argument("--lf", action="store_true", help="also LLaMA-Factory's LoRA on the same model and row (see above)")
    p.add_argument("--lf-python", default=DEFAULT_LF_PYTHON,
                   help="with --lf: python of a venv with LLaMA-Factory (default: $LLAMAFACTORY_PYTHON or ../lf-venv/bin/python)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in every child (default: torch's own)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds before a child process is killed")
    p.add_argument("--verbose", action="store_true", help="show each child's own output")
    args = p.parse_args(argv)
    if args.child:
        return child(args.child)
    if not (Path(args.shared) / CONFIG / "config.json").is_file():
        print(f"shared reference files not found under {args.shared} (set --shared or ERNIEKIT_SHARED)", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in ("merged", "split")]:
        raise SystemExit(f"unknown mode(s) {unknown}; known: merged, split")
    if args.four_bit:
        modes.append("split-4bit")
    if args.lf:
        if not Path(args.lf_python).exists():
            raise SystemExit(f"--lf-python {args.lf_python}: no such file (benchmarks/install_llamafactory.sh builds that venv)")
        modes.append("lf")
    started = (time.perf_counter(), os.getloadavg()[0], git_revision())
    main_versions = versions(sys.executable)
    lf_versions = versions(args.lf_python) if args.lf else None
    for line in describe_header(
            f"MoE LoRA SFT per MoE layer, routed experts {' vs '.join(modes)}; random ERNIE-4.5-21B-A3B widths (64 experts top-6, "
            f"2 shared, hidden 2560, moe_intermediate 1536) with vocab {args.vocab}, 1 dense + 1 / 2 MoE layers, LoRA r{args.lora_r} "
            f"(alpha {2 * args.lora_r}) on every target incl. routed experts, fp32, one packed row of {args.length} tokens per step, AdamW",
            args, main_versions, lf_versions):
        print(line)
    print(f"plan: {args.warmup} warm-up + {args.steps} timed step(s) per child; {args.rounds} round(s), interleaved, each "
          f"(model, mode) in its own process" + ("; lf: LLaMA-Factory's default `lora_target: all` (no routed-expert adapters)"
                                                 if args.lf else "; LLaMA-Factory: not run (--lf)"), flush=True)
    base = {"shared": args.shared, "vocab": args.vocab, "length": args.length, "lora_r": args.lora_r, "warmup": args.warmup,
            "steps": args.steps, "threads": args.threads}
    runs: dict[tuple[str, str], list[dict]] = {(m, c): [] for m in MODELS for c in modes}
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="moe-lora-bench-") as tmp_name:
        tmp = Path(tmp_name)
        for rnd in range(1, args.rounds + 1):
            for model_name, moe in MODELS.items():
                for mode in modes:
                    if mode == "split-4bit" and rnd > args.four_bit_rounds:
                        continue
                    spec = {**base, "moe_layers": moe, "compute": "split" if mode == "split-4bit" else mode}
                    if mode == "split-4bit":  # loading, the weights' bytes and one step that shows it trains
                        spec.update(model_dir=save_model(spec, tmp / f"model-{model_name}"), warmup=0, steps=args.four_bit_steps)
                    if mode == "lf":
                        r = run_lf(spec, save_model(spec, tmp / f"model-{model_name}"), tmp, f"{model_name}-{mode}-{rnd}", args)
                    else:
                        r = run_child(spec, tmp, f"{model_name}-{mode}-{rnd}", args)
                    runs[(model_name, mode)].append(r)
                    if "error" in r:
                        print(f"round {rnd} {model_name} {mode}: FAILED {r['error']}", flush=True)
                    elif r.get("load_only"):
                        print(f"round {rnd} {model_name} {mode}: loaded (no step); peak anonymous memory while loading "
                              f"{r['load_peak_anon_mib']:.0f} MiB, checkpoint {r['checkpoint_mib']:.0f} MiB", flush=True)
                    elif "unavailable" in r:
                        print(f"round {rnd} {model_name} {mode}: {r['unavailable']} (load_in_4bit left 0 experts modules in NF4)", flush=True)
                    elif mode == "lf":
                        print(f"round {rnd} {model_name} lf: steps {r['step_seconds']} s (warm-up {r.get('warmup_seconds')} s), "
                              f"{r['tokens_per_step'] / mean(r['step_seconds']):.1f} tokens/s; peak RSS {r['peak_rss_mib']:.0f} MiB; "
                              f"adapted {', '.join(r['adapted'])}; trainable {r['trainable_params']:,}; loss {r['losses']}; "
                              f"child wall {r['child_wall_seconds']} s", flush=True)
                    else:
                        print(f"round {rnd} {model_name} {mode}: steps {r['step_seconds']} s (warm-up {r.get('warmup_seconds')} s), "
                              f"{r['tokens_per_step'] / mean(r['step_seconds']):.1f} tokens/s; peak RSS {r['peak_rss_mib']:.0f} MiB "
                              f"(after build {r['model_rss_mib']:.0f}); split modules {r['split_modules']}, 4-bit experts modules "
                              f"{r['experts_4bit_modules']}; loss {r['losses']}; child wall {r['child_wall_seconds']} s", flush=True)
    summary = summarise(runs, modes, args)
    print_tables(summary, modes, args)
    targets = {}
    if {"merged", "split"} <= set(modes) and summary["per_layer"].get("merged", {}).get("tokens_per_second") and \
            summary["per_layer"].get("split", {}).get("tokens_per_second"):
        ratio = summary["per_layer"]["split"]["tokens_per_second"] / summary["per_layer"]["merged"]["tokens_per_second"]
        peaks_ok = all(summary["configs"][(m, "split")]["peak_rss_mib"] <= summary["configs"][(m, "merged")]["peak_rss_mib"]
                       for m in MODELS)
        targets = {"split_over_merged_per_moe_layer": round(ratio, 3), "speed_target_1.5x_met": ratio >= 1.5,
                   "peak_rss_split_le_merged": peaks_ok}
        print(f"\nsplit / merged real tokens/s per MoE layer: {ratio:.2f}x (target >= 1.5x: {'met' if ratio >= 1.5 else 'NOT met'}); "
              f"peak RSS split <= merged for L1 and L2: {'yes' if peaks_ok else 'NO'}")
    t_start, load_start, revision = started
    wall, load_end, revision_end = time.perf_counter() - t_start, os.getloadavg()[0], git_revision()
    print(load_note(load_start, load_end, wall))
    if revision_end != revision:
        print(f"WARNING: the checkout changed during the run ({revision} -> {revision_end}); the rounds may have run different code")
    print(json.dumps({
        "benchmark": "moe_lora",
        "config": {"model": "random ERNIE-4.5-21B-A3B widths, 1 dense + 1 / 2 MoE layers", "vocab": args.vocab,
                   "length": args.length, "lora_r": args.lora_r, "lora_alpha": 2 * args.lora_r, "rounds": args.rounds,
                   "warmup": args.warmup, "steps": args.steps, "threads": args.threads, "dtype": "float32",
                   "metric": "tokens per step / mean wall clock of a timed optimizer step; per MoE layer from L2 - L1",
                   "git": revision if revision_end == revision else [revision, revision_end]},
        "machine": machine(),
        "versions": {"main": main_versions, **({"llamafactory_venv": lf_versions} if lf_versions else {})},
        "configs": {f"{m}/{c}": s for (m, c), s in summary["configs"].items()},
        "per_moe_layer": summary["per_layer"],
        "targets": targets,
        "notes": notes,
        "wall_seconds": round(wall, 1),
        "loadavg_1min": [round(load_start, 2), round(load_end, 2)],
    }))
    return 0


def summarise(runs, modes, args) -> dict:
    configs = {}
    for key, rs in runs.items():
        ok = [r for r in rs if "error" not in r and "unavailable" not in r]
        if ok and all(r.get("load_only") for r in ok):
            configs[key] = {"unavailable": "loaded only (--four-bit-steps 0)", "load_peak_anon_mib": max(r["load_peak_anon_mib"] for r in ok),
                            **{k: ok[0][k] for k in ("checkpoint_mib", "experts_4bit_bytes", "experts_bf16_bytes") if k in ok[0]}}
            continue
        if not ok:
            first = rs[0] if rs else {}
            configs[key] = {"unavailable": first["unavailable"]} if "unavailable" in first else {
                "error": next((r["error"] for r in rs if "error" in r), "not run")}
            continue
        steps = [s for r in ok for s in r["step_seconds"]]
        configs[key] = {
            "rounds": len(ok),
            "step_seconds": round(mean(steps), 3),
            "per_round_step_seconds": [round(mean(r["step_seconds"]), 3) for r in ok],
            "all_step_seconds": [r["step_seconds"] for r in ok],
            "warmup_seconds": [r.get("warmup_seconds") for r in ok],
            "tokens_per_step": ok[0]["tokens_per_step"],
            "tokens_per_second": round(ok[0]["tokens_per_step"] / mean(steps), 2),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in ok),
            "per_round_peak_rss_mib": [r["peak_rss_mib"] for r in ok],
            "model_rss_mib": [r["model_rss_mib"] for r in ok],
            "trainable_params": ok[0]["trainable_params"],
            "split_modules": ok[0]["split_modules"],
            "experts_4bit_modules": ok[0]["experts_4bit_modules"],
            **({"load_peak_anon_mib": max(r["load_peak_anon_mib"] for r in ok)} if "load_peak_anon_mib" in ok[0] else {}),
            **({"adapted": ok[0]["adapted"]} if "adapted" in ok[0] else {}),
            **{k: ok[0][k] for k in ("checkpoint_mib", "experts_4bit_bytes", "experts_bf16_bytes") if k in ok[0]},
            "losses": [r["losses"] for r in ok],
            "threads": ok[0]["threads"],
            "child_wall_seconds": [r.get("child_wall_seconds") for r in rs],
            **({"failed_rounds": [r["error"] for r in rs if "error" in r]} if len(ok) < len(rs) else {}),
        }
    per_layer = {}
    for mode in modes:
        one, two = configs[("L1", mode)], configs[("L2", mode)]
        if "step_seconds" not in one or "step_seconds" not in two:
            per_layer[mode] = {"unavailable": one.get("unavailable") or two.get("unavailable") or one.get("error") or two.get("error")}
            continue
        seconds = two["step_seconds"] - one["step_seconds"]
        rounds = [b - a for a, b in zip(one["per_round_step_seconds"], two["per_round_step_seconds"])]
        tokens = one["tokens_per_step"]
        per_layer[mode] = {
            "seconds_per_step": round(seconds, 3),
            "tokens_per_second": round(tokens / seconds, 2) if seconds > 0 else None,
            "per_round_seconds": [round(s, 3) for s in rounds],
            "per_round_tokens_per_second": [round(tokens / s, 2) if s > 0 else None for s in rounds],
            "peak_rss_mib": round(two["peak_rss_mib"] - one["peak_rss_mib"], 1),
            "trainable_params": two["trainable_params"] - one["trainable_params"],
        }
    return {"configs": configs, "per_layer": per_layer}


def print_tables(summary, modes, args) -> None:
    configs, per_layer = summary["configs"], summary["per_layer"]
    print("\n| model | experts | rounds | seconds / step (per round) | tokens/s | peak RSS MiB (per round) | trainable params | loss (first step) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (model, mode), s in configs.items():
        label = f"{model} (1 dense + {MODELS[model]} MoE)"
        if "step_seconds" not in s:
            print(f"| {label} | {mode} | {s.get('unavailable') or 'FAILED: ' + s['error'].replace('|', '/')} | | | | | |")
            continue
        print(f"| {label} | {mode} | {s['rounds']} | {s['step_seconds']:.2f} ({', '.join(f'{x:.2f}' for x in s['per_round_step_seconds'])}) | "
              f"{s['tokens_per_second']:.1f} | {s['peak_rss_mib']:.0f} ({', '.join(f'{x:.0f}' for x in s['per_round_peak_rss_mib'])}) | "
              f"{s['trainable_params']:,} | {s['losses'][0][0]:.4f} |")
    merged = per_layer.get("merged", {}).get("tokens_per_second")
    print("\nper MoE layer (L2 - L1):\n")
    print("| experts | seconds / step (per round) | real tokens/s | x merged | peak RSS MiB | trainable params |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode, s in per_layer.items():
        if "seconds_per_step" not in s:
            print(f"| {mode} | {s['unavailable']} | | | | |")
            continue
        tps = s["tokens_per_second"]
        ratio = f"{tps / merged:.2f}x" if tps and merged else "-"
        print(f"| {mode} | {s['seconds_per_step']:.2f} ({', '.join(f'{x:.2f}' for x in s['per_round_seconds'])}) | "
              f"{tps:.1f} | {ratio} | {s['peak_rss_mib']:.0f} | {s['trainable_params']:,} |" if tps else
              f"| {mode} | {s['seconds_per_step']:.2f} | n/a (L2 not slower than L1) | - | {s['peak_rss_mib']:.0f} | {s['trainable_params']:,} |")
    loads = [(model, s) for (model, mode), s in configs.items() if "checkpoint_mib" in s]
    if loads:
        print("\n4-bit routed experts, loading and weights:\n")
        print("| model | checkpoint read (fp32) MiB | peak anonymous memory while loading MiB | 4-bit expert bytes | the same in bf16 | ratio |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for model, s in loads:
            print(f"| {model} | {s['checkpoint_mib']:.0f} | {s['load_peak_anon_mib']:.0f} | {s['experts_4bit_bytes']:,} | "
                  f"{s['experts_bf16_bytes']:,} | {s['experts_4bit_bytes'] / s['experts_bf16_bytes']:.3f} |")
        print("(peak anonymous memory: RssAnon sampled every 5 ms while `load_model(..., load_in_4bit=True)` ran, so the "
              "memory-mapped checkpoint's pages are not counted; it includes the Python and torch start-up, ~0.4 GiB)")
    print(f"\ntokens: one packed row of {args.length} random token ids (4 samples) per step, all real; seconds: wall clock of a "
          "timed optimizer step (forward, backward, AdamW), mean over the timed steps of every round; peak RSS: VmHWM of "
          "the child process; per MoE layer: L2 minus L1.")


if __name__ == "__main__":
    sys.exit(main())
