"""What the benchmarks share: setup, one training run per child process, the real-token count, tables, JSON.

Parent side (the benchmark scripts, main venv): arguments, the tiny model (written once per run), the data subset
every mode trains on, machine/version capture, running each mode in its own child process, summarising.

Child side (`python benchmarks/_common.py SPEC.json`, in the main venv or in LLaMA-Factory's own venv): sets the
thread count, installs the probe (below), runs one runner from `benchmarks/runners/`, writes a result JSON. This
module imports only the standard library at the top, so the child runs in either venv without erniekit-lite's
dependencies colliding with a peer's.

The probe: the ONE throughput metric every mode is measured with
- `transformers.Trainer.train` is wrapped (no trainer here overrides it; TRL's and LLaMA-Factory's subclasses
  inherit it). The wrapper times the call with a wall clock (`seconds`, the headline denominator for every mode;
  the Trainer's own `train_runtime` is recorded beside it), keeps the `TrainOutput`, and, before training starts,
  instruments that trainer instance:
  - its data collator gets a subclass whose `__call__` measures each collated batch (`batch_stats`) and attaches
    the numbers to the batch under `_bench_stats`;
  - its `training_step` (instance attribute, so subclass overrides are wrapped too) pops `_bench_stats` and adds
    them up. Only batches that reached a training step count: the batch the dataloader prefetches past the last
    step never does.
- `batch_stats` counts, per batch: real tokens (non-pad input tokens the model forwards), forwarded positions
  (pads included) and sequences (samples, or chosen/rejected sequences in DPO):
  - a 2-D `attention_mask` (padded rows; LLaMA-Factory neat-packing's segment ids 1, 2, 3, ... with 0 for pad):
    real = mask != 0;
  - a 4-D float `attention_mask` (LLaMA-Factory neat packing under sdpa, where its collator expands the segment
    ids into a block-diagonal mask): a position is real iff it may attend to itself (diagonal entry 0; pad rows
    are fully masked);
  - no `attention_mask` (padding-free [1, T] rows: erniekit-lite packed SFT, TRL padding_free / bfd): every input
    token is real (no padding is added);
  - erniekit-lite packed DPO forwards `packed_input_ids` (padding-free) and carries the padded-layout 2-D
    `attention_mask` for TRL's loss: real from that mask, forwarded positions = `packed_input_ids` size;
  - sequences: where `position_ids` exist, the real positions with position 0; otherwise the rows.
  DPO counts each token of the policy batch once per step (the reference pass re-runs the same tokens in every
  mode: adapter disabled, not precomputed).
- Peak memory: VmHWM (high-water resident set) of the child process, read from /proc/self/status at exit.
  `ru_maxrss` is not used: Linux folds the parent's high-water mark into a child's across fork + exec.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STATS_KEY = "_bench_stats"
DEFAULT_SHARED = os.environ.get("ERNIEKIT_SHARED", str(ROOT.parent / "shared"))
# LLaMA-Factory lives in its own virtual environment (its own pins); it is never a dependency of erniekit-lite
DEFAULT_LF_PYTHON = os.environ.get("LLAMAFACTORY_PYTHON", str(ROOT.parent / "lf-venv" / "bin" / "python"))


# ---------------------------------------------------------------- parent side: arguments and setup


def add_common_args(p, *, steps: int, batch: int, samples: int | None, modes: list[str], lf: bool = True) -> None:
    p.add_argument("--shared", default=DEFAULT_SHARED,
                   help="shared reference files (default: $ERNIEKIT_SHARED or ../shared beside the repo)")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps of a padded mode (and of every peer mode)")
    p.add_argument("--batch", type=int, default=batch, help="per-device batch of a padded mode (and of every peer mode)")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank (alpha = 2r) on all seven projections")
    p.add_argument("--rounds", type=int, default=1, help="passes over the modes, interleaved (mode A, B, ..., A, B, ...)")
    p.add_argument("--samples", type=int, default=samples,
                   help="records of the demo file every mode trains on, the first N (default: %(default)s; None = all)")
    p.add_argument("--packed-batch", type=int, default=None,
                   help="erniekit-lite packed rows per step (default: matched to the padded samples per step)")
    p.add_argument("--modes", default=",".join(modes), help="comma-separated subset of: " + ", ".join(modes))
    if lf:
        p.add_argument("--lf-python", default=DEFAULT_LF_PYTHON,
                       help="python of a venv with LLaMA-Factory (default: $LLAMAFACTORY_PYTHON or ../lf-venv/bin/python); "
                            "LF modes are skipped with a note when it does not exist")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in every child (default: torch's own)")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--released-shape", action="store_true",
                   help="random weights at the released ERNIE-4.5-0.3B size (hidden 1024, 18 layers) instead")
    p.add_argument("--timeout", type=int, default=3600, help="seconds before a mode's child process is killed")
    p.add_argument("--verbose", action="store_true", help="show each child's own output")


def selected_modes(args, known: list[str]) -> list[str]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in known]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; known: {', '.join(known)}")
    return modes


def quiet_transformers() -> None:
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*pin_memory.*")  # no accelerator on CPU


def write_tokenizer(shared: str | Path, dst: Path) -> Path:
    """The REAL tokenizer re-saved into `dst` (as tokenizer.json: loads in ~1 s instead of ~6 s from sentencepiece,
    in either venv)."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(Path(shared) / "ernie45" / "ernie-4.5-0.3b-base-pt").save_pretrained(dst)
    # The released tokenizer_config's remote-code `auto_map` is ignored without trust_remote_code, but it makes
    # transformers 5.6 (LLaMA-Factory's venv) take the tokenizer for custom code when LLaMA-Factory saves it after
    # training, and fail (`custom_object_save` -> FileNotFoundError '.../transformers/integrations.ggml.py').
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("auto_map", None)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return dst


def write_model(tmp: Path, args) -> Path:
    """The tiny random ERNIE 4.5 dense model with the real tokenizer (write_tokenizer), written once per benchmark run."""
    from erniekit_lite.tiny import write_tiny

    tok_dir = write_tokenizer(args.shared, tmp / "tokenizer")
    model_dir = write_tiny(str(tmp / "tiny"), "dense", str(tok_dir), hidden_size=args.hidden_size, layers=args.layers,
                           released_shape=args.released_shape)
    if args.released_shape:
        args.hidden_size, args.layers = 1024, 18
    return Path(model_dir)


def write_records(src: Path, dst: Path, samples: int | None) -> list[dict]:
    """The first `samples` records of `src`, written to `dst`: every mode (erniekit-lite, TRL, LLaMA-Factory) reads
    exactly these records."""
    records = json.loads(src.read_text(encoding="utf-8"))
    if samples is not None:
        records = records[:samples]
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    return records


# What a result measured: the package, the recipes and the benchmark code. Results files and docs are left out,
# so regenerating one result (or editing the docs) does not mark the next one's code as changed.
MEASURED_PATHS = ("erniekit_lite", "recipes", "pyproject.toml", "benchmarks/*.py", "benchmarks/runners")


TOKENIZER = Path("ernie45") / "ernie-4.5-0.3b-base-pt"  # under ../shared: the real ERNIE 4.5 tokenizer


def demo_file(shared: str, name: str) -> Path:
    """`shared`/data/llamafactory/`name`, with the real tokenizer beside it; exit 2 with one line when either is missing."""
    demo = Path(shared) / "data" / "llamafactory" / name
    if not (Path(shared) / TOKENIZER).is_dir() or not demo.is_file():
        print(f"shared reference files not found under {shared} (set --shared or ERNIEKIT_SHARED)", file=sys.stderr)
        raise SystemExit(2)
    return demo


def git_revision() -> str | None:
    """HEAD plus '+dirty' when the measured code (MEASURED_PATHS) differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *MEASURED_PATHS],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


_VERSIONS = """
import json, platform
from importlib import metadata
out = {"python": platform.python_version()}
for name in ("torch", "transformers", "peft", "trl", "datasets", "accelerate", "llamafactory"):
    try:
        out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
print(json.dumps(out))
"""


def versions(python: str) -> dict:
    """Package versions of the environment behind `python` (read from its metadata; nothing heavy is imported)."""
    try:
        proc = subprocess.run([python, "-c", _VERSIONS], capture_output=True, text=True, timeout=120)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}


def machine() -> dict:
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = _status_kib("MemTotal", "/proc/meminfo")
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem / 2**20, 1) if mem else None}


def describe_header(title: str, args, main_versions: dict, lf_versions: dict | None) -> list[str]:
    m = machine()
    v = main_versions
    lines = [f"# {title}",
             f"machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB; torch threads: "
             + (str(args.threads) if args.threads else "torch's default (see the JSON line)"),
             f"main venv ({sys.executable}): python {v.get('python')}, torch {v.get('torch')}, transformers {v.get('transformers')}, "
             f"peft {v.get('peft')}, trl {v.get('trl')}, datasets {v.get('datasets')}, accelerate {v.get('accelerate')}"]
    if lf_versions is not None:
        w = lf_versions
        lines.append(f"LLaMA-Factory venv ({args.lf_python}): llamafactory {w.get('llamafactory')}, python {w.get('python')}, "
                     f"torch {w.get('torch')}, transformers {w.get('transformers')}, peft {w.get('peft')}, trl {w.get('trl')}, "
                     f"datasets {w.get('datasets')}, accelerate {w.get('accelerate')}")
    return lines


# ---------------------------------------------------------------- parent side: one mode, one child process


def run_child(python: str, runner: str, params: dict, tmp: Path, name: str, args) -> dict:
    """Run `runners/<runner>.py` with `params` in a fresh `python` process; its result, or {"error": one line}."""
    spec = tmp / f"{name}.spec.json"
    result = tmp / f"{name}.result.json"
    spec.write_text(json.dumps({"runner": runner, "params": params, "threads": args.threads, "verbose": args.verbose,
                                "result": str(result)}))
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1",  # everything is local; never reach for the network
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp / "hf-datasets-cache"),  # datasets' map caches stay in the temp dir
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore" if not args.verbose else env.get("PYTHONWARNINGS", ""),
    })
    cmd = [python, str(Path(__file__).resolve()), str(spec)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, stdout=None if args.verbose else subprocess.PIPE,
                              stderr=None if args.verbose else subprocess.STDOUT, text=True, env=env, timeout=args.timeout)
        output, code = proc.stdout or "", proc.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        code = f"timeout after {args.timeout} s"
    wall = time.perf_counter() - t0
    if code != 0 or not result.is_file():
        if not args.verbose:  # the temp dir goes away: show the end of the failed child's output now
            tail = "\n".join(output.splitlines()[-25:])
            print(f"--- {name}: last lines of the failed child's output\n{tail}\n---", file=sys.stderr, flush=True)
        why = f"killed by signal {-code}{' (out of memory?)' if code == -9 else ''}" if isinstance(code, int) and code < 0 else f"exit {code}"
        return {"error": f"{why}: {error_line(output)}", "child_wall_seconds": round(wall, 1)}
    r = json.loads(result.read_text())
    r["child_wall_seconds"] = round(wall, 1)
    return r


def error_line(output: str) -> str:
    """The most telling line of a failed child's output: the last exception line, else the last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Exit", "Interrupt")) or head in ("AssertionError", "KeyError"):
            return ln[:300]
    return (lines[-1] if lines else "no output")[:300]


def run_modes(modes: list[str], spec, tmp: Path, args) -> dict[str, list[dict]]:
    """Every mode once per round, interleaved (A, B, ..., A, B, ...), each in its own child; `spec(mode, round)`
    gives (python, runner, params). A failed mode is recorded with its error line and the run goes on."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rnd in range(args.rounds):
        for mode in modes:
            python, runner, params = spec(mode, rnd)
            r = run_child(python, runner, params, tmp, f"{mode}-{rnd}", args)
            runs[mode].append(r)
            if "error" in r:
                print(f"round {rnd + 1} {mode}: FAILED ({r['error']})", flush=True)
                continue
            print(f"round {rnd + 1} {mode}: {r['real_tokens']} real tokens in {r['steps']} steps, {r['seconds']:.2f} s = "
                  f"{r['real_tokens'] / r['seconds']:.0f} real tokens/s; peak RSS {r['peak_rss_mib']} MiB; "
                  f"reported {fmt_reported([r.get('reported', {})])}"
                  + (f"; reward accuracy {r['rewards/accuracies']:.2f}" if r.get("rewards/accuracies") is not None else "")
                  + "".join(f"; NOTE {n}" for n in r.get("notes", [])), flush=True)
    return runs


# ---------------------------------------------------------------- parent side: summary, table, JSON


def summarise(runs: list[dict]) -> dict:
    """One mode over its rounds: sums for tokens and seconds, so tokens/s = total real tokens / total seconds."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"] if runs else "not run", "rounds": len(runs)}
    real = sum(r["real_tokens"] for r in ok)
    seconds = sum(r["seconds"] for r in ok)
    steps = sum(r["steps"] for r in ok)
    positions = sum(r["positions"] for r in ok)
    peaks = [r["peak_rss_mib"] for r in ok if r.get("peak_rss_mib") is not None]
    out = {
        "rows_per_step": ok[0]["params_batch"],
        "steps": ok[0]["steps"],
        "real_tokens": real,
        "forwarded_positions": positions,
        "non_pad_share": round(real / positions, 4) if positions else None,
        "sequences": sum(r["sequences"] for r in ok),
        "real_tokens_per_step": round(real / steps, 1) if steps else None,
        "sequences_per_step": round(sum(r["sequences"] for r in ok) / steps, 2) if steps else None,
        "seconds": round(seconds, 3),
        "real_tokens_per_second": round(real / seconds, 2) if seconds else 0.0,
        "train_runtime": round(sum(r["train_runtime"] for r in ok if r.get("train_runtime") is not None), 3),
        "per_round_real_tokens_per_second": [round(r["real_tokens"] / r["seconds"], 2) for r in ok],
        "train_loss": [r.get("train_loss") for r in ok],
        "peak_rss_mib": max(peaks) if peaks else None,
        "per_round_peak_rss_mib": [r.get("peak_rss_mib") for r in ok],
        "baseline_rss_mib": [r.get("baseline_rss_mib") for r in ok],
        "reported": [r.get("reported", {}) for r in ok],
        "threads": ok[0].get("threads"),
        "child_wall_seconds": [r.get("child_wall_seconds") for r in runs],
        "notes": ok[0].get("notes", []),
    }
    if len(ok) < len(runs):
        out["failed_rounds"] = [r["error"] for r in runs if "error" in r]
    for key in ("rewards/accuracies", "rewards/margins"):
        if any(key in r for r in ok):
            out[key] = [r.get(key) for r in ok]
    return out


def fmt_reported(reported: list[dict]) -> str:
    """A peer's own throughput figure(s), averaged over rounds, as `name value`."""
    keys = [k for k in (reported[0] if reported else {})]
    parts = []
    for k in keys:
        vals = [r[k] for r in reported if r.get(k) is not None]
        if vals:
            parts.append(f"{k} {sum(vals) / len(vals):.0f}")
    return "; ".join(parts) or "-"


def print_table(summary: dict[str, dict], baseline: str | None, unit: str) -> None:
    base = summary.get(baseline, {}).get("real_tokens_per_second") if baseline else None
    print(f"| mode | {unit} x steps | real tokens (per step) | non-pad share | seconds | real tokens/s | "
          f"x {baseline or 'baseline'} | peak RSS MiB | train loss | peer-reported figure |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for mode, s in summary.items():
        if "error" in s:
            print(f"| {mode} | FAILED: {s['error'].replace('|', '/')} | | | | | | | | |")
            continue
        ratio = f"{s['real_tokens_per_second'] / base:.2f}x" if base else "-"
        peak = f"{s['peak_rss_mib']:.0f}" if s["peak_rss_mib"] is not None else "n/a"
        losses = [x for x in s["train_loss"] if x is not None]
        loss = f"{sum(losses) / len(losses):.4f}" if losses else "-"
        print(f"| {mode} | {s['rows_per_step']} x {s['steps']} (~{s['sequences_per_step']:g} seq/step) | "
              f"{s['real_tokens']} ({s['real_tokens_per_step']:.0f}) | {s['non_pad_share']:.1%} | {s['seconds']:.2f} | "
              f"{s['real_tokens_per_second']:.0f} | {ratio} | {peak} | {loss} | {fmt_reported(s['reported'])} |")


def summarise_modes(runs: dict[str, list[dict]], preferred: str) -> tuple[dict[str, dict], str | None]:
    """Per-mode summaries and the baseline mode the ratios divide by (`preferred`, else erniekit-padded)."""
    summary = {m: summarise(rs) for m, rs in runs.items()}
    baseline = preferred if preferred in summary and "error" not in summary[preferred] else (
        "erniekit-padded" if "erniekit-padded" in summary else None)
    return summary, baseline


def print_tail(*, benchmark: str, config: dict, summary: dict, baseline: str | None, extra: dict, notes: list[str],
               started: tuple[float, float, str | None], main_versions: dict, lf_versions: dict | None) -> None:
    """Notes, the load and checkout warnings, then the one JSON line; `started` = (perf_counter, loadavg, git rev)."""
    t_start, load_start, revision = started
    wall, load_end, revision_end = time.perf_counter() - t_start, os.getloadavg()[0], git_revision()
    for note in notes:
        print("note:", note)
    print(load_note(load_start, load_end, wall))
    if revision_end != revision:
        print(f"WARNING: the checkout changed during the run ({revision} -> {revision_end}); the modes may have run different code")
    base_tps = summary[baseline]["real_tokens_per_second"] if baseline else None
    print(json.dumps({
        "benchmark": benchmark,
        "config": {**config, "metric": "probe real tokens / wall clock of Trainer.train()",
                   "git": revision if revision_end == revision else [revision, revision_end]},
        "machine": machine(),
        "versions": {"main": main_versions, **({"llamafactory_venv": lf_versions} if lf_versions else {})},
        "baseline": baseline,
        "modes": summary,
        "x_baseline": {m: round(s["real_tokens_per_second"] / base_tps, 3) for m, s in summary.items() if base_tps and "error" not in s},
        **extra,
        "notes": notes,
        "wall_seconds": round(wall, 1),
        "loadavg_1min": [round(load_start, 2), round(load_end, 2)],
    }))


def load_note(load_start: float, load_end: float, wall: float) -> str:
    return (f"wall time: {wall:.1f} s; 1-min load average {load_start:.2f} at start, {load_end:.2f} at end"
            + (" (above 1: other processes may have competed; timings may be noisy)" if max(load_start, load_end) > 1.0 else ""))


# ---------------------------------------------------------------- child side: the probe


def _status_kib(field: str, path: str = "/proc/self/status") -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])  # "VmHWM:   123456 kB"
    except OSError:
        pass
    return None


def peak_rss_mib() -> tuple[float | None, str]:
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return round(hwm / 1024, 1), "VmHWM"
    import resource  # not Linux: ru_maxrss (bytes on macOS, KiB elsewhere); may include the parent's at spawn

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round((peak / 1024 if sys.platform == "darwin" else peak) / 1024, 1), "ru_maxrss"


def batch_stats(batch) -> tuple[int, int, int]:
    """(real tokens, forwarded positions, sequences) of one collated batch; see the module docstring."""
    import torch

    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() == 2:
        real = mask != 0
    elif torch.is_tensor(mask) and mask.dim() == 4:
        real = mask.diagonal(dim1=-2, dim2=-1)[:, 0] == 0  # LF neat packing, block-diagonal float mask
    else:
        real = torch.ones_like(ids, dtype=torch.bool)  # padding-free
    packed = batch.get("packed_input_ids")
    positions = int(packed.numel()) if torch.is_tensor(packed) else int(ids.numel())
    pos = batch.get("position_ids")
    if torch.is_tensor(pos) and pos.shape == ids.shape:
        sequences = int(((pos == 0) & real).sum())
    else:
        sequences = int(ids.shape[0])
    return int(real.sum()), positions, sequences


class Probe:
    def __init__(self):
        self.real = self.positions = self.sequences = self.steps = self.uncounted = 0
        self.seconds = None
        self.output = None
        self.trainer = None

    def add(self, stats) -> None:
        self.steps += 1
        if stats is None:
            self.uncounted += 1
            return
        real, positions, sequences = stats
        self.real += int(real)
        self.positions += int(positions)
        self.sequences += int(sequences)

    def result(self) -> dict:
        metrics = getattr(self.output, "metrics", None) or {}
        if self.uncounted:
            raise RuntimeError(f"{self.uncounted} of {self.steps} training steps got a batch the probe did not see")
        return {
            "real_tokens": self.real,
            "positions": self.positions,
            "sequences": self.sequences,
            "steps": self.steps,
            "seconds": self.seconds,
            "train_runtime": metrics.get("train_runtime"),
            "train_loss": round(float(self.output.training_loss), 4) if self.output is not None else None,
        }


def _counting_collator(collator):
    """`collator`, made to attach `batch_stats` to every batch it returns."""
    cls = type(collator)
    if not isinstance(collator, (types.FunctionType, types.MethodType, functools.partial)):
        try:  # a subclass keeps isinstance checks and attributes (dunder calls look up the type, not the instance)
            collator.__class__ = type(f"Counting{cls.__name__}", (cls,), {"__call__": lambda self, features: _count(cls.__call__(self, features))})
            return collator
        except TypeError:
            pass
    return lambda features: _count(collator(features))


def _count(batch):
    batch[STATS_KEY] = batch_stats(batch)
    return batch


def instrument() -> Probe:
    """Wrap `transformers.Trainer.train` so the next training run is timed and its batches counted."""
    import transformers

    probe = Probe()
    original = transformers.Trainer.train

    def train(self, *args, **kwargs):
        if probe.trainer is not None:
            return original(self, *args, **kwargs)
        probe.trainer = self
        self.data_collator = _counting_collator(self.data_collator)
        step = self.training_step

        def training_step(model, inputs, *a, **k):
            probe.add(inputs.pop(STATS_KEY, None))
            return step(model, inputs, *a, **k)

        self.training_step = training_step
        t0 = time.perf_counter()
        out = original(self, *args, **kwargs)
        probe.seconds = round(time.perf_counter() - t0, 3)
        probe.output = out
        return out

    transformers.Trainer.train = train
    return probe


def worker(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import importlib.util

    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    if not spec["verbose"]:
        quiet_transformers()
    path = BENCH / "runners" / f"{spec['runner']}.py"
    module_spec = importlib.util.spec_from_file_location(f"bench_runner_{spec['runner']}", path)
    runner = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(runner)
    baseline = _status_kib("VmRSS")
    probe = instrument()
    extra = runner.run(spec["params"], probe) or {}
    result = {**probe.result(), **extra}
    result["peak_rss_mib"], result["peak_rss_source"] = peak_rss_mib()
    result["baseline_rss_mib"] = round(baseline / 1024, 1) if baseline else None
    result["threads"] = torch.get_num_threads()
    result["params_batch"] = spec["params"].get("batch")
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1]))
