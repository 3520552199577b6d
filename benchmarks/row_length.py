"""Packed vs padded SFT at the row shapes users run: about 16k tokens per step, several models, >= 3 rounds.

    python benchmarks/row_length.py [--models tiny128,tiny256,0.3b-L2,0.3b-L4] [--shapes 512x32,2048x8,8192x2,32768x1]
                                    [--tokens 32768] [--rounds 3] [--lf-python ../lf-venv/bin/python]
                                    [--lf-model tiny256] [--lf-shapes 2048x8,8192x2] [--timeout 900] [--quick]

Shapes are `max_length x rows` (16k token slots a step). For each, erniekit-lite trains LoRA r16 on all seven
projections (fp32, no activation checkpointing, `benchmarks/runners/erniekit.py`) on the shared alpaca demo:
- packed: `rows` padding-free rows of up to max_length per step (`data.packing: true`, per-sample attention);
- padded: `rows` samples per step, each padded to the longest in its batch (`data.packing: false`); the 32768 x 1
  shape is packed only (a padded batch of one sample has no padding to lose).
Every mode gets about `--tokens` real tokens per run (steps = tokens / real tokens per step, at least 2: the first
step pays one-time costs).
LLaMA-Factory's neat packing (its greedy-knapsack rows of max_length, pad-filled, with a block-diagonal 4-D mask
under sdpa) runs beside them on `--lf-model` at `--lf-shapes` in its own venv, killed after `--timeout` seconds
(its masks grow as the square of the row: a timeout is reported as such).

Models: `tiny128` is `erniekit-lite tiny`'s default (hidden 128, 4 layers), `tiny256` the other benchmarks' model
(hidden 256, 4 layers), `0.3b-L<n>` the released ERNIE-4.5-0.3B shape (hidden 1024, 16 heads, 2 KV heads,
intermediate 3072) with its 18 layers cut to n; all with the real 103k-token tokenizer and random weights. Per-layer
cost extrapolates: with two cuts (e.g. L2 and L4) the table adds the 18-layer figure, t(18) = t(a) + (18 - a) x
(t(b) - t(a)) / (b - a) per token, for each mode.

Metric (benchmarks/_common.py, as in sft.py): real tokens the training steps consumed, counted by the benchmark's
probe, over the wall clock of `Trainer.train()`; min / median / max over the rounds; peak RSS (VmHWM) of each run.
Then the limit: model FLOPs per real token (LoRA: forward and input-gradient matmuls of the frozen weights, 4 per
weight, 6 per adapter weight; causal attention per sample; the LM head at trained positions only, forward and
input gradient), the machine's measured fp32 matmul FLOP/s (best of 5, a 4096^3 product), and the fraction
reached. And the per-sample attention loop at 32768-token rows: calls per layer, the dispatch cost per call, and
its share of the step.

Output: a header, a table per model, the limit and attention lines, then ONE final JSON line.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

sys.path.insert(0, str(C.ROOT))  # run from a checkout without installing

FULL_LAYERS = 18  # ERNIE-4.5-0.3B


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shared", default=C.DEFAULT_SHARED)
    p.add_argument("--models", default="tiny128,tiny256,0.3b-L2,0.3b-L4")
    p.add_argument("--shapes", default="512x32,2048x8,8192x2,32768x1")
    p.add_argument("--tokens", type=int, default=32768, help="real tokens per run (about; at least one step)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lf-python", default=C.DEFAULT_LF_PYTHON)
    p.add_argument("--lf-model", default="tiny256")
    p.add_argument("--lf-shapes", default="2048x8,8192x2")
    p.add_argument("--timeout", type=int, default=900, help="seconds before a run is killed (LLaMA-Factory at long rows)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--quick", action="store_true", help="smoke check: one round, tiny128 only, two steps per run, no LLaMA-Factory")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.models, args.tokens, args.lf_shapes = 1, "tiny128", 1, ""
    return args


def parse_shape(text: str) -> tuple[int, int]:
    length, rows = text.lower().split("x")
    return int(length), int(rows)


def write_model(tmp: Path, name: str, tokenizer_dir: Path) -> Path:
    """A random ERNIE 4.5 dense model with the real tokenizer: tiny<hidden>, or 0.3b-L<layers> (the released shape cut)."""
    from erniekit_lite.tiny import write_tiny

    if name.startswith("tiny"):
        return write_tiny(str(tmp / name), "dense", str(tokenizer_dir), hidden_size=int(name[4:]), layers=4)
    if not name.startswith("0.3b-L"):
        raise SystemExit(f"unknown model {name!r}: tiny<hidden> or 0.3b-L<layers>")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from erniekit_lite.tiny import tiny_config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tiny_config("dense", -(-len(tokenizer) // 64) * 64, released_shape=True)
    config.num_hidden_layers = int(name[len("0.3b-L"):])
    config.max_position_embeddings = 131072
    torch.manual_seed(0)
    out = tmp / name
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def matmul_peak() -> float:
    """Best of 5 fp32 4096^3 matrix products, FLOP/s, on this process's threads."""
    import torch

    a, b = torch.randn(4096, 4096), torch.randn(4096, 4096)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(5))
    return 2 * 4096**3 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def flops_per_token(config, lora_r: int, stats: dict) -> dict:
    """Model FLOPs per real token of LoRA training, as this benchmark trains (see the module docstring)."""
    h, layers, v = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads, kv, d, inter = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.intermediate_size
    shapes = [(h, heads * d), (h, kv * d), (h, kv * d), (heads * d, h), (h, inter), (h, inter), (inter, h)]
    weights = sum(i * o for i, o in shapes) * layers
    adapters = sum(lora_r * (i + o) for i, o in shapes) * layers
    body = 4 * weights + 6 * adapters
    attention = 6 * heads * d * stats["causal_span"] * layers  # QK^T and PV over the causal half, x3 with backward
    head = 4 * h * v * stats["trained_share"]
    return {"body": body, "attention": round(attention), "head": round(head), "total": round(body + attention + head)}


def data_stats(samples) -> dict:
    lengths = [len(s) for s in samples]
    trained = sum(sum(1 for t in s.labels[1:] if t != -100) for s in samples)
    return {"samples": len(lengths), "mean_length": statistics.mean(lengths),
            "causal_span": sum(n * n for n in lengths) / sum(lengths),  # mean attention span per token, x2
            "trained_share": trained / sum(lengths)}


def attention_loop(config, lengths: list[int]) -> dict:
    """The per-sample attention (`packed_sdpa`) of one layer over a packed row: forward + backward time, the number
    of calls, and the dispatch cost per call (the same loop on 1-token samples)."""
    import torch

    from erniekit_lite.model.attention import packed_sdpa_forward

    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    module = torch.nn.Module()

    def run(lens):
        total = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(1, heads, total, d, requires_grad=True)
        k, v = (torch.randn(1, kv, total, d, requires_grad=True) for _ in range(2))
        t = time.perf_counter()
        out, _ = packed_sdpa_forward(module, q, k, v, None, scaling=d**-0.5, cu_seq_lens_q=cu)
        out.sum().backward()
        return time.perf_counter() - t

    run(lengths)
    full = min(run(lengths) for _ in range(3))
    tiny = min(run([1] * len(lengths)) for _ in range(3))
    return {"row_tokens": sum(lengths), "calls_per_layer": len(lengths), "layer_seconds": round(full, 4),
            "dispatch_seconds_per_call": round(tiny / len(lengths), 7)}


def stat(values: list[float]) -> dict:
    return {"min": round(min(values), 1), "median": round(statistics.median(values), 1), "max": round(max(values), 1)}


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start, load_start, revision = time.perf_counter(), os.getloadavg()[0], C.git_revision()
    shared = Path(args.shared)
    demo = C.demo_file(args.shared, "alpaca_en_demo.json")
    tokenizer_src = shared / C.TOKENIZER
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    shapes = [parse_shape(s) for s in args.shapes.split(",") if s.strip()]
    lf_shapes = [parse_shape(s) for s in args.lf_shapes.split(",") if s.strip()]
    notes = []
    if lf_shapes and not Path(args.lf_python).exists():
        notes.append(f"LLaMA-Factory skipped: no python at {args.lf_python} (--lf-python)")
        lf_shapes = []

    import torch
    from transformers import AutoConfig

    from erniekit_lite.data.prepare import prepare
    from erniekit_lite.model.load import load_tokenizer
    from erniekit_lite.recipe import DataSection

    C.quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)
    main_versions = C.versions(sys.executable)
    lf_versions = C.versions(args.lf_python) if lf_shapes else None
    peak = matmul_peak()

    with tempfile.TemporaryDirectory(prefix="erniekit-bench-rows-") as tmp:
        tmp = Path(tmp)
        tok_dir = tmp / "tokenizer"
        load_tokenizer(str(tokenizer_src)).save_pretrained(tok_dir)
        cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
        cfg.pop("auto_map", None)  # see _common.write_model: LLaMA-Factory's transformers trips over it
        (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
        tokenizer = load_tokenizer(str(tok_dir))
        data_path = tmp / "data" / "alpaca.json"
        records = C.write_records(demo, data_path, None)
        model_dirs = {m: write_model(tmp, m, tok_dir) for m in models}
        configs = {m: AutoConfig.from_pretrained(d) for m, d in model_dirs.items()}

        plans, stats = {}, {}
        for length, rows in shapes:
            planned = prepare(DataSection(train=[{"path": str(data_path), "format": "alpaca"}], max_length=length, packing=True),
                              tokenizer, log=lambda *a, **k: None)
            mean_row = statistics.mean(len(r.input_ids) for r in planned.train.rows)
            stats[length] = {**data_stats(planned.train.samples), "mean_row": mean_row, "efficiency": planned.train.packing_efficiency,
                             "first_row": list(planned.train.rows[0].seq_lengths)}
            s = stats[length]
            # at least two steps: the first pays one-time costs (first-touch page faults of the step's buffers)
            plans[(length, rows, "packed")] = max(2, round(args.tokens / (rows * mean_row)))
            plans[(length, rows, "padded")] = max(2, round(args.tokens / (rows * s["mean_length"])))
            plans[(length, rows, "lf-neat-packing")] = plans[(length, rows, "packed")]

        runs_list = []  # (model, length, rows, mode)
        for m in models:
            for length, rows in shapes:
                runs_list.append((m, length, rows, "packed"))
                if length < 32768:
                    runs_list.append((m, length, rows, "padded"))
                if m == args.lf_model and (length, rows) in lf_shapes:
                    runs_list.append((m, length, rows, "lf-neat-packing"))

        for line in C.describe_header(f"SFT at about 16k tokens per step: packed vs padded (erniekit-lite) and LLaMA-Factory neat "
                                      f"packing; LoRA r{args.lora_r} x7, fp32, alpaca demo ({len(records)} records)", args,
                                      main_versions, lf_versions):
            print(line)
        print(f"fp32 matmul peak of this machine (4096^3, best of 5): {peak / 1e9:.0f} GFLOP/s")
        for length, _ in shapes:
            s = stats[length]
            print(f"max_length {length}: {s['samples']} samples, mean {s['mean_length']:.1f} tokens, trained share "
                  f"{s['trained_share']:.1%}; packed rows mean {s['mean_row']:.0f} tokens, efficiency {s['efficiency']:.1%}")
        print("plan (steps per run): " + ", ".join(f"{m} {length}x{rows} {mode} {plans[(length, rows, mode)]}"
                                                  for m, length, rows, mode in runs_list if m == models[0]), flush=True)

        results: dict[tuple, list[dict]] = {key: [] for key in runs_list}
        for rnd in range(args.rounds):
            for key in runs_list:
                m, length, rows, mode = key
                out = str(tmp / f"run-{m}-{length}x{rows}-{mode}-{rnd}")
                common = {"model_dir": str(model_dirs[m]), "data_path": str(data_path), "out_dir": out, "max_length": length,
                          "lora_r": args.lora_r, "verbose": args.verbose, "batch": rows, "steps": plans[(length, rows, mode)]}
                if mode == "lf-neat-packing":
                    python, runner, params = args.lf_python, "llamafactory", {**common, "stage": "sft", "neat_packing": True}
                else:
                    python, runner, params = sys.executable, "erniekit", {**common, "method": "sft", "data_format": "alpaca",
                                                                         "packing": mode == "packed"}
                r = C.run_child(python, runner, params, tmp, f"{m}-{length}x{rows}-{mode}-{rnd}", args)
                results[key].append(r)
                if "error" in r:
                    print(f"round {rnd + 1} {m} {length}x{rows} {mode}: FAILED ({r['error']})", flush=True)
                else:
                    print(f"round {rnd + 1} {m} {length}x{rows} {mode}: {r['real_tokens']} real tokens in {r['seconds']:.1f} s = "
                          f"{r['real_tokens'] / r['seconds']:.0f} tokens/s, peak RSS {r['peak_rss_mib']:.0f} MiB", flush=True)

        attention = {m: attention_loop(configs[m], stats[max(stats)]["first_row"]) for m in models if max(stats) >= 32768}

    summary = summarise(results, models, shapes, configs, stats, args, peak)
    print()
    print_tables(summary, models, shapes, attention)
    C.print_tail(benchmark="row_length",
                 config={"models": models, "shapes": [f"{a}x{b}" for a, b in shapes], "tokens_per_run": args.tokens,
                         "rounds": args.rounds, "lora_r": args.lora_r, "threads": args.threads or torch.get_num_threads(),
                         "lf_model": args.lf_model, "lf_shapes": [f"{a}x{b}" for a, b in lf_shapes], "timeout": args.timeout},
                 summary=summary, baseline=None, extra={"matmul_peak_flops": round(peak), "attention_loop": attention},
                 notes=notes, started=(t_start, load_start, revision), main_versions=main_versions, lf_versions=lf_versions)
    return 0


def summarise(results, models, shapes, configs, stats, args, peak) -> dict:
    out: dict[str, dict] = {}
    for (m, length, rows, mode), rs in results.items():
        ok = [r for r in rs if "error" not in r]
        entry: dict = {"rounds": len(rs)}
        if len(ok) < len(rs):
            entry["errors"] = [r["error"] for r in rs if "error" in r]
        if ok:
            tps = [r["real_tokens"] / r["seconds"] for r in ok]
            flops = flops_per_token(configs[m], args.lora_r, stats[length])
            entry.update({
                "steps": ok[0]["steps"], "real_tokens": ok[0]["real_tokens"], "tokens_per_second": stat(tps),
                "seconds": stat([r["seconds"] for r in ok]), "peak_rss_mib": max(r["peak_rss_mib"] for r in ok),
                "non_pad_share": round(ok[0]["real_tokens"] / ok[0]["positions"], 4),
                "flops_per_token": flops, "fraction_of_peak": round(flops["total"] * statistics.median(tps) / peak, 4),
                "seconds_per_token": [r["seconds"] / r["real_tokens"] for r in ok],
            })
        out.setdefault(m, {})[f"{length}x{rows} {mode}"] = entry
    cuts = sorted((int(m[len("0.3b-L"):]), m) for m in models if m.startswith("0.3b-L"))
    if len(cuts) >= 2:  # per-layer cost extrapolates: t(18) from the two smallest cuts, per mode and shape
        (a, ma), (b, mb) = cuts[0], cuts[1]
        full = {}
        for key, ea in out[ma].items():
            eb = out[mb].get(key, {})
            if "seconds_per_token" in ea and "seconds_per_token" in eb:
                ta, tb = statistics.median(ea["seconds_per_token"]), statistics.median(eb["seconds_per_token"])
                t18 = ta + (FULL_LAYERS - a) * (tb - ta) / (b - a)
                full[key] = {"tokens_per_second": {"median": round(1 / t18, 1)}, "extrapolated_from": [ma, mb]}
        out[f"0.3b-L{FULL_LAYERS} (extrapolated)"] = full
    for m in out:
        for (length, rows) in shapes:
            packed, padded, lf = (out[m].get(f"{length}x{rows} {k}", {}) for k in ("packed", "padded", "lf-neat-packing"))
            med = lambda e: e.get("tokens_per_second", {}).get("median")  # noqa: E731
            if med(packed) and med(padded):
                packed["x_padded"] = round(med(packed) / med(padded), 2)
            if med(packed) and med(lf):
                packed["x_llamafactory"] = round(med(packed) / med(lf), 2)
    return out


def print_tables(summary, models, shapes, attention) -> None:
    def cell(e):
        if "tokens_per_second" not in e:
            return "; ".join(e.get("errors", ["-"]))[:80].replace("|", "/") if e else "-"
        s = e["tokens_per_second"]
        return f"{s['median']:.0f}" if "min" not in s else f"{s['min']:.0f} / **{s['median']:.0f}** / {s['max']:.0f}"

    for m, entries in summary.items():
        print(f"### {m}")
        print("| max_length x rows | padded tok/s (min / median / max) | packed tok/s | packed / padded | LLaMA-Factory neat packing "
              "tok/s | packed / LF | peak RSS MiB (padded, packed, LF) | packed: % of fp32 matmul peak |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for length, rows in shapes:
            packed, padded, lf = (entries.get(f"{length}x{rows} {k}", {}) for k in ("packed", "padded", "lf-neat-packing"))
            rss = ", ".join(f"{e['peak_rss_mib']:.0f}" if "peak_rss_mib" in e else "-" for e in (padded, packed, lf))
            frac = f"{packed['fraction_of_peak']:.1%}" if "fraction_of_peak" in packed else "-"
            print(f"| {length} x {rows} | {cell(padded)} | {cell(packed)} | {packed.get('x_padded', '-')} | {cell(lf)} | "
                  f"{packed.get('x_llamafactory', '-')} | {rss} | {frac} |")
        print()
    for m in models:
        any_entry = next((e for e in summary[m].values() if "flops_per_token" in e), None)
        if any_entry:
            f = any_entry["flops_per_token"]
            print(f"{m}: model FLOPs per real token (at the first shape's data) {f['total'] / 1e6:.1f} M = body {f['body'] / 1e6:.1f} M "
                  f"+ attention {f['attention'] / 1e6:.2f} M + LM head at trained positions {f['head'] / 1e6:.1f} M")
    for m, a in attention.items():
        print(f"{m}: per-sample attention over a {a['row_tokens']}-token row: {a['calls_per_layer']} sdpa calls per layer, "
              f"{a['layer_seconds'] * 1000:.1f} ms per layer forward + backward, dispatch {a['dispatch_seconds_per_call'] * 1e6:.0f} us "
              f"per call ({a['dispatch_seconds_per_call'] * a['calls_per_layer'] * 1000:.1f} ms per layer)")


if __name__ == "__main__":
    sys.exit(main())
