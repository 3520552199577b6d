"""What many test files share: the CLI run in-process, and a recipe file written from a few settings."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from erniekit_lite.cli import main

ROOT = Path(__file__).resolve().parents[1]
IDENTITY = ROOT / "recipes" / "data" / "identity.jsonl"
PAIRS = ROOT / "recipes" / "data" / "identity_dpo.jsonl"


def shared_data(recipe: Path) -> list[str]:
    """Overrides pointing a shipped recipe's `../shared/...` data files at the shared files wherever they are
    (`ERNIEKIT_SHARED`), so the test does not depend on ../shared lying beside the working directory."""
    from conftest import SHARED

    data = yaml.safe_load(Path(recipe).read_text(encoding="utf-8")).get("data") or {}
    return [f"data.{split}.{i}.path={SHARED / source['path'].removeprefix('../shared/')}"
            for split in ("train", "eval") for i, source in enumerate(data.get(split) or [])
            if isinstance(source, dict) and source.get("path", "").startswith("../shared/")]


# A native engine (llama.cpp) built for instructions this CPU lacks dies by a signal (SIGILL); in the test process that
# would end the whole pytest run. In a child, it fails the one test that called it, with the engine's last lines.
RESULT = "\x1eerniekit-result\x1e"
CHILD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("engine_calls", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
result = getattr(module, sys.argv[2])(*json.loads(sys.argv[3]))
sys.stdout.write("\\n" + sys.argv[4] + json.dumps(result))
"""


def in_child(module: Path, function: str, *args, timeout: int = 900):
    """`function(*args)` from the Python file `module`, run in a child process; its JSON-able result. A child killed
    by a signal, or exiting non-zero, fails the calling test (not the run) with the signal and the child's last lines."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(module), function, json.dumps(args, default=str), RESULT],
                          capture_output=True, text=True, errors="replace", timeout=timeout)
    last = "\n".join((done.stdout.split(RESULT)[0] + "\n" + done.stderr).strip().splitlines()[-12:])
    if done.returncode < 0:
        try:
            how = signal.Signals(-done.returncode).name
        except ValueError:
            how = f"signal {-done.returncode}"
        pytest.fail(f"{function} (in a child process) was killed by {how}; its last lines:\n{last}", pytrace=False)
    if done.returncode != 0 or RESULT not in done.stdout:
        pytest.fail(f"{function} (in a child process) exited with status {done.returncode}; its last lines:\n{last}", pytrace=False)
    return json.loads(done.stdout.split(RESULT, 1)[1])


def run_logits(run: Path):
    """A finished run's model as `erniekit-lite chat` loads it (base + adapter), scoring a fixed row: its logits."""
    import torch

    from erniekit_lite.chat import load

    model, _ = load(str(run))
    with torch.no_grad():
        return model(input_ids=torch.tensor([[1, 563, 600, 318, 45, 2]])).logits


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """`erniekit-lite ARGV...` in this process: (exit status, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def write_recipe(path: Path, model_dir: Path, *, method: str = "sft", lora: dict | None = None, data: dict | None = None,
                 train: dict | None = None, model: dict | None = None, output: dict | None = None, out: Path | None = None,
                 **changes) -> Path:
    """A recipe YAML at `path` for `model_dir`: the identity demo data (its pairs for DPO) at max_length 128 unless
    `data` says otherwise; `lora` None is full fine-tuning; `out` (default: `out` beside the file) is output.dir.
    `changes` set single keys last, a double underscore for each level: `train__max_steps=4`, `lora=None`."""
    recipe = {
        "model": {"path": str(model_dir), **(model or {})},
        "method": method,
        "data": {"train": [str(PAIRS if method == "dpo" else IDENTITY)], "max_length": 128, **(data or {})},
        "output": {"dir": str(out if out is not None else path.parent / "out"), **(output or {})},
        "train": dict(train or {}),
    }
    if lora is not None:
        recipe["lora"] = lora
    for dotted, value in changes.items():
        node = recipe
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    path.write_text(yaml.safe_dump(recipe))
    return path


# Multiple-choice questions for the lm-eval tasks below: (question, choices, index of the right one)
QUESTIONS = [
    ("What colour is the sky on a clear day?", ["blue", "green", "red"], 0),
    ("2 + 2 =", ["3", "4", "5", "22"], 1),
    ("The capital of France is", ["Berlin", "Paris"], 1),
    ("The opposite of hot is", ["cold", "warm", "tepid"], 0),
    ("The largest planet is", ["Mars", "Jupiter", "Venus"], 1),
    ("Water freezes at", ["0 C", "50 C", "100 C"], 0),
    ("A baby cat is a", ["kitten", "puppy", "calf", "foal"], 0),
    ("Ice is", ["hot", "cold"], 1),
]


def write_lm_eval_tasks(folder: Path) -> Path:
    """Three tasks in lm-eval's YAML format over local JSONL files: tiny_mc (multiple choice on QUESTIONS), tiny_gen
    (their answers, generated) and tiny_who (the identity demo's answers, generated)."""
    identity = [json.loads(line) for line in IDENTITY.read_text().splitlines()]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (folder / "gen.jsonl").write_text("".join(json.dumps({"question": q, "answer": c[a]}) + "\n" for q, c, a in QUESTIONS))
    (folder / "who.jsonl").write_text("".join(json.dumps({"question": r["src"][0], "answer": r["tgt"][0]}) + "\n" for r in identity))

    def task(name: str, data: str, body: str) -> None:
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / data}\ntest_split: test\n{body}")

    metric = "metric_list:\n  - metric: {}\n    aggregation: mean\n    higher_is_better: true\n"
    task("tiny_mc", "mc.jsonl", 'output_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
         'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n' + metric.format("acc"))
    generate = 'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n' \
               'generation_kwargs:\n  until: ["\\n"]\n  do_sample: false\n  max_gen_toks: 24\n'
    task("tiny_gen", "gen.jsonl", generate + metric.format("exact_match"))
    task("tiny_who", "who.jsonl", generate + metric.format("exact_match"))
    return folder


def make_adapter_visible(run: Path) -> Path:
    """Draw a LoRA run's B matrices large (they are near zero after a few steps), so that base, adapter and merge
    give visibly different answers; saved back into the run."""
    import torch

    from erniekit_lite.model.load import load_model

    with torch.no_grad():
        model = load_model(str(run), "float32", "sdpa")
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
        model.save_pretrained(run)
    return run


def visible_lora_run(tmp: Path, arch: str, tokenizer_dir: Path | None, hidden_size: int = 64) -> Path:
    """A LoRA run on a tiny model with the given (real) tokenizer (MoE: every routed and shared expert adapted), its
    adapter made visible: what engines must reproduce."""
    from erniekit_lite.tiny import write_tiny

    base = write_tiny(str(tmp / "base"), arch, tokenizer_dir and str(tokenizer_dir), hidden_size=hidden_size,
                      layers=3 if arch == "moe" else 2)
    recipe = write_recipe(tmp / "r.yaml", base, lora={"r": 4, "alpha": 8}, out=tmp / "run",
                          train={"learning_rate": 1e-2, "max_steps": 1, "per_device_train_batch_size": 2, "activation_checkpointing": False})
    assert main(["train", str(recipe)]) == 0
    return make_adapter_visible(tmp / "run")


def identity_run(tmp: Path, model_dir: Path) -> Path:
    """Full fine-tuning that learns the identity answers (the quick start's settings)."""
    recipe = write_recipe(tmp / "r.yaml", model_dir, out=tmp / "run", data={"max_length": 256, "packing": True},
                          train={"learning_rate": 3e-3, "lr_scheduler_type": "cosine", "warmup_steps": 10, "max_steps": 150,
                                 "per_device_train_batch_size": 1, "activation_checkpointing": False, "logging_steps": 50,
                                 "save_steps": 150, "seed": 0})
    assert main(["train", str(recipe)]) == 0
    return tmp / "run"


@contextlib.contextmanager
def trls_own_head(model, outputs: tuple):
    """TRL's fused LM head back on `model` (the causal LM, under no wrapper) while TRL's own padded batches run, as
    TRL's DPO/KTO `__init__` puts it on; the project's trainers take it off (erniekit_lite/train/scored.py)."""
    from trl.trainer.utils import add_fused_lm_head

    from erniekit_lite.train import scored

    add_fused_lm_head(model, outputs=outputs)
    try:
        yield
    finally:
        scored.without_trl_head(model)


def move_off_the_reference(model, std: float = 0.05) -> None:
    """A new LoRA adapter's trained B (zero at the start) drawn from N(0, std), so the policy differs from its
    reference (the base, or the adapter as it started) and a preference loss's comparison has teeth."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name and p.requires_grad:
                p.normal_(0, std)
