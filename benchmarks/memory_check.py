"""The memory estimate (`erniekit_lite/memory.py`, printed by `validate`) against measurements on tiny models.

    python benchmarks/memory_check.py [--quick]

CPU has no allocator peak counter, so this measures what it can measure exactly, for one training step of the
tiny dense and MoE ERNIE 4.5 models (real transformers classes, `erniekit_lite.tiny.tiny_config`, hidden 256,
4 layers) on one packed row, scored through erniekit-lite's own LM-head path (`scoring.py`):
- weights, gradients, optimizer states: bytes of the parameters, their `.grad`s and AdamW's states after real
  optimizer steps (torch.optim.AdamW(fused=True), what `adamw_torch_fused` builds); a 4-bit base (loaded by
  `load_model(..., load_in_4bit=True)` from a saved checkpoint) adds its quantization states, by storage;
- activations: bytes of the tensors autograd saves during one training forward
  (`torch.autograd.graph.saved_tensors_hooks`, deduplicated by storage, parameters excluded), split into the
  backbone and the LM-head part (logits) by running the backbone alone as well;
- peak: every tensor storage allocated while a step runs is tracked from creation to release (a
  `TorchDispatchMode` that registers a weakref finalizer on each new storage); the peak of their sum plus the
  parameters and optimizer states (which predate it) is the step's peak tensor memory (two micro-batches of
  gradient accumulation, then the optimizer step, after a warm-up step that created the optimizer states).
The MoE cases run the routed experts' LoRA split (model/expert_lora.py, the default) unless they say merged; the
estimate of a 4-bit case counts the model built on the meta device, as validate does.
The estimate's `overhead` (CUDA context, allocator fragmentation) has no CPU counterpart and is left out of the
comparison. Output: one table per case (estimate vs measured per component) and a final JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

MB = 1e6


class StorageTracker(TorchDispatchMode):
    """Live bytes of the tensor storages created while active, and their peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.current

    def _release(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self.live or key in inputs:  # views and in-place results allocate nothing
                continue
            self.live[key] = size
            self.current += size
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._release, key)
        return out


@contextlib.contextmanager
def saved_tensors(exclude: set[int], into: dict):
    """Record the storages autograd saves for backward (deduplicated; `exclude`: parameter storages)."""

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in exclude and t.device.type == "cpu":
            into[key] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


@dataclass
class Case:
    name: str
    arch: str = "dense"
    hidden: int = 256
    layers: int = 4
    vocab: int = 8192
    tokens: int = 2048
    samples: int = 4
    trained: float = 0.5  # fraction of each sample's tokens that are trained (its response)
    lora: bool = False
    checkpointing: bool = False
    precision: str = "fp32"  # fp32 | bf16 (bf16 weights) | autocast (fp32 weights, bf16 autocast) | bf16 autocast (both)
    chunk_elements: int | None = None  # override scoring.MAX_CHUNK_ELEMENTS
    lora_rank: int = 16
    lora_dropout: float = 0.0
    released_shape: bool = False  # the released 0.3B / 21B-A3B layer shapes (random weights) instead of hidden/layers
    expert_compute: str = "split"  # lora.expert_compute: split (model/expert_lora.py, the default) | merged (peft's)
    expert_r: int | None = None  # lora.expert_r: the routed experts' own rank (None: lora_rank)
    load_in_4bit: bool = False  # model.load_in_4bit: saved, then loaded through load_model (NF4 linears and routed experts)

    @property
    def dtype(self):
        return torch.bfloat16 if self.precision in ("bf16", "bf16 autocast") else torch.float32

    @property
    def autocast(self) -> bool:
        return self.precision in ("autocast", "bf16 autocast")


def build(case: Case):
    from transformers import AutoModelForCausalLM

    import erniekit_lite.model.attention  # noqa: F401  (registers packed_sdpa)
    from erniekit_lite.tiny import tiny_config

    config = tiny_config(case.arch, case.vocab, case.hidden, case.layers, released_shape=case.released_shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="packed_sdpa", dtype=case.dtype)
    model.config.use_cache = False
    if case.load_in_4bit:  # as `train` loads a QLoRA base: from a checkpoint, quantized as it is read
        import tempfile

        from erniekit_lite.model.load import load_model

        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            del model
            model = load_model(folder, "bfloat16" if case.dtype == torch.bfloat16 else "float32", "packed_sdpa", load_in_4bit=True)
    return config, model


def lora_section(case: Case):
    from erniekit_lite.recipe import LoraSection

    return LoraSection(r=case.lora_rank, alpha=2 * case.lora_rank, dropout=case.lora_dropout, expert_r=case.expert_r,
                       expert_compute=case.expert_compute)


def adapt(model, case: Case):
    if not case.lora:
        return model
    from erniekit_lite.model.lora import apply_lora

    return apply_lora(model, lora_section(case))


def packed_inputs(case: Case, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [case.tokens // case.samples] * case.samples
    lengths[-1] += case.tokens - sum(lengths)
    ids = torch.randint(5, case.vocab, (1, case.tokens), generator=g)
    labels = ids.clone()
    start = 0
    for n in lengths:
        labels[0, start : start + n - int(n * case.trained)] = -100  # the prompt
        start += n
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    inputs = {
        "input_ids": ids,
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
    }
    scored = int((labels[0, 1:] != -100).sum())
    return inputs, labels, scored


def estimate_for(case: Case, config, model, scored: int):
    from erniekit_lite import memory

    if case.load_in_4bit:  # as validate counts: the unquantized model built on the meta device, with its adapters
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=case.dtype)
        model = adapt(model, case)
    params = memory.params_of(model, case.lora_dropout)
    run = memory.Run(
        tokens=case.tokens,
        scored=scored,
        dtype_bytes=2 if case.dtype == torch.bfloat16 else 4,
        autocast=case.autocast,
        load_in_4bit=case.load_in_4bit,
        checkpointing=case.checkpointing,
        attention="sdpa",
        chunk_elements=case.chunk_elements or 2**27,
        device="cpu",
    )
    return memory.estimate(memory.Shape.from_config(config), params, run)


def quantization_states(model) -> dict[int, int]:
    """The storages (data pointer -> bytes) a 4-bit model keeps beside its parameters: each bitsandbytes Linear4bit's
    quantization state (absmax, NF4 code, and the double quantization's absmax, code and offset) and each 4-bit
    routed-experts module's statistics buffers (model/expert_4bit.py). By storage: bitsandbytes' double-quantization
    code table is one tensor shared by every Linear4bit quantized in the process, and counts once."""
    from erniekit_lite.model import expert_4bit

    tensors = []
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            tensors += [state.absmax, state.code]
            if state.nested:
                tensors += [state.state2.absmax, state.state2.code, state.offset]
        if expert_4bit.is_4bit(module):
            tensors += [getattr(module, f"{name}_{stat}") for name in module.nf4_shapes for stat in expert_4bit.STATS]
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def measure(case: Case) -> dict:
    """One case: estimate (from the same model, as validate does on the meta device) and measurements."""
    from erniekit_lite.model.lora import unwrap
    from erniekit_lite.train import scoring
    from erniekit_lite.train.scored import take as take_scoring

    config, model = build(case)
    model = adapt(model, case)
    base = unwrap(model)
    if case.checkpointing:
        base.activation_checkpointing_enable()  # what Trainer does (non-reentrant; input grads for LoRA)
    take_scoring(base)
    model.train()
    inputs, labels, scored = packed_inputs(case)
    old_chunk = scoring.MAX_CHUNK_ELEMENTS
    if case.chunk_elements:
        scoring.MAX_CHUNK_ELEMENTS = case.chunk_elements
    try:
        est = estimate_for(case, config, model, scored)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.autocast)
        params = list(model.parameters())
        quant = quantization_states(model)
        param_keys = {p.untyped_storage().data_ptr() for p in params} | set(quant)
        trainable = [p for p in params if p.requires_grad]

        def loss_of(out):
            return -out.log_probs.sum() / max(1, out.log_probs.numel())

        # activations saved by one training forward: backbone alone, then backbone + LM head. With checkpointing,
        # the rope cos/sin the layers are recomputed from stay alive without autograd saving them: added.
        backbone: dict[int, int] = {}
        rope: list[int] = []
        hook = base.base_model.rotary_emb.register_forward_hook(lambda m, i, out: rope.append(sum(t.untyped_storage().nbytes() for t in out)))
        with autocast, saved_tensors(param_keys, backbone):
            base.base_model(**inputs, use_cache=False)
        hook.remove()
        both: dict[int, int] = {}
        with autocast, saved_tensors(param_keys, both):
            out = model(**inputs, score_labels=labels)
        del out
        if case.checkpointing:
            backbone[-1] = both[-1] = rope[0]
        saved_backbone, saved_all = sum(backbone.values()), sum(both.values())

        optimizer = torch.optim.AdamW(trainable, lr=1e-5, fused=True)

        def step(micro_batches: int) -> None:
            for _ in range(micro_batches):  # gradient accumulation: the gradients live while activations are
                with autocast:
                    out = model(**inputs, score_labels=labels)
                loss_of(out).backward()
                del out
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step(1)  # warm-up: creates the optimizer states
        state_bytes = sum(
            v.untyped_storage().nbytes() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
        )
        gc.collect()
        tracker = StorageTracker()
        with tracker:
            step(2)  # measured: two micro-batches of gradient accumulation, then the optimizer step
        # the weights: the parameters (packed NF4 bytes under 4-bit) and the 4-bit quantization states beside them
        param_bytes = sum(p.untyped_storage().nbytes() for p in params) + sum(quant.values())
        grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
        measured = {
            "weights": param_bytes,
            "gradients": grad_bytes,
            "optimizer": state_bytes,
            "activations": saved_backbone,
            "logits": saved_all - saved_backbone,
            "peak": param_bytes + state_bytes + tracker.peak,  # parameters and optimizer states predate the tracker
        }
    finally:
        scoring.MAX_CHUNK_ELEMENTS = old_chunk
    estimated = {
        "weights": est.weights,
        "gradients": est.gradients,
        "optimizer": est.optimizer,
        "activations": est.activations,
        "logits": est.logits,
        "peak": est.total - est.overhead,
    }
    return {"case": case.name, "scored": scored, "estimate": estimated, "measured": measured, "transient": est.transient}


CASES = [
    Case("dense full fp32"),
    Case("dense full fp32 ckpt", checkpointing=True),
    Case("dense LoRA fp32", lora=True),
    Case("dense LoRA fp32 ckpt", lora=True, checkpointing=True),
    Case("dense LoRA fp32 dropout", lora=True, lora_dropout=0.05),
    Case("moe full fp32", arch="moe"),
    Case("moe LoRA fp32", arch="moe", lora=True),
    Case("moe LoRA fp32 ckpt", arch="moe", lora=True, checkpointing=True),
    Case("dense full autocast", precision="autocast", tokens=1024),
    Case("dense LoRA bf16+autocast", precision="bf16", lora=True, tokens=1024),
    Case("dense LoRA fp32 chunked", lora=True, chunk_elements=2**20, trained=0.9),
    Case("dense LoRA real vocab", lora=True, vocab=103424, tokens=2048, trained=0.9),
    Case("dense LoRA bf16 chunked", precision="bf16", lora=True, vocab=32768, tokens=1024, trained=0.9, chunk_elements=2**23),
    Case("released 0.3B shape, LoRA r32, ckpt", released_shape=True, vocab=103424, lora=True, lora_rank=32, checkpointing=True, trained=0.9),
]
# Shapes none of CASES has (hidden 192/320, 3 and 5 layers, other vocabularies, token counts, samples per row,
# trained fractions and LoRA rank 8), added after memory.py's fitted constants (the working set's "quarter of a
# layer", the per-call autocast copies) were fixed at commit 83cafd1: the error on these is a held-out error.
HELD_OUT = [
    Case("held-out dense full, hidden 192 x 3", hidden=192, layers=3, vocab=12288, tokens=1536, samples=3, trained=0.7),
    Case("held-out dense LoRA r8 ckpt, hidden 320 x 5", hidden=320, layers=5, vocab=20000, tokens=3072, samples=6,
         trained=0.6, lora=True, lora_rank=8, checkpointing=True),
    Case("held-out moe LoRA r8, hidden 192 x 5", arch="moe", hidden=192, layers=5, vocab=12288, tokens=1536, samples=3,
         trained=0.7, lora=True, lora_rank=8),
    Case("held-out moe full ckpt autocast, hidden 192 x 3", arch="moe", hidden=192, layers=3, vocab=12288, tokens=1024,
         samples=2, trained=0.8, checkpointing=True, precision="autocast"),
    Case("held-out dense LoRA bf16 chunked, hidden 320 x 3", precision="bf16", hidden=320, layers=3, vocab=50000,
         tokens=1536, samples=4, trained=0.8, lora=True, chunk_elements=2**22),
]
# The routed experts' other paths (issue 31), on CASES' shapes, added after the constants were fixed: peft's merged
# expert LoRA (the MoE LoRA cases above run split, the default), a lower expert rank (lora.expert_r), and QLoRA with
# the routed experts in NF4 (model/expert_4bit.py; hidden 256 makes each expert's gate_up [256, 256] and down
# [256, 128] whole 64 x 256-element blocks: one quantization state per stack, as on the released 21B-A3B), loaded from
# a checkpoint by load_model, bf16 base and adapters under bf16 autocast, as the QLoRA recipes train.
EXPERT_PATHS = [
    Case("moe LoRA fp32 merged", arch="moe", lora=True, expert_compute="merged"),
    Case("moe LoRA fp32 ckpt merged", arch="moe", lora=True, checkpointing=True, expert_compute="merged"),
    Case("moe LoRA fp32 expert_r 4", arch="moe", lora=True, expert_r=4),
    Case("moe QLoRA 4-bit experts, bf16 autocast", arch="moe", lora=True, load_in_4bit=True, precision="bf16 autocast", tokens=1024),
    Case("moe QLoRA 4-bit experts, bf16 autocast ckpt", arch="moe", lora=True, load_in_4bit=True, precision="bf16 autocast",
         tokens=1024, checkpointing=True),
    # a shape none of the others has (hidden 512: the 4-bit per-stack path too), small vocabulary and few trained
    # positions, so the peak is in the layer phase (the dense layer's recompute and its 4096 x 512 4-bit MLP weights)
    Case("held-out moe QLoRA r8 expert_r 4 ckpt, hidden 512 x 3", arch="moe", hidden=512, layers=3, vocab=2048, tokens=768,
         samples=3, trained=0.2, lora=True, lora_rank=8, expert_r=4, load_in_4bit=True, precision="bf16 autocast",
         checkpointing=True),
]
QUICK = [c for c in CASES if c.name in ("dense full fp32", "dense LoRA fp32 ckpt", "moe LoRA fp32", "dense LoRA fp32 chunked")]


def table(result: dict) -> str:
    rows = [f"{result['case']} (scored positions {result['scored']})", "| component | estimate MB | measured MB | est/meas |", "| --- | ---: | ---: | ---: |"]
    for key in ("weights", "gradients", "optimizer", "activations", "logits", "peak"):
        e, m = result["estimate"][key], result["measured"][key]
        ratio = f"{e / m:.3f}" if m else ("-" if not e else "inf")
        rows.append(f"| {key} | {e / MB:.2f} | {m / MB:.2f} | {ratio} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="four cases only")
    p.add_argument("--case", action="append", help="run only cases whose name contains this")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    everything = CASES + HELD_OUT + EXPERT_PATHS
    cases = QUICK + HELD_OUT[:1] + EXPERT_PATHS[3:4] if args.quick else everything
    if args.case:
        cases = [c for c in everything if any(s in c.name for s in args.case)]
    print(f"torch {torch.__version__}, CPU threads {torch.get_num_threads()}; estimate excludes its overhead term\n")
    results = []
    for case in cases:
        start = time.perf_counter()
        result = measure(case)
        results.append(result)
        print(table(result))
        print(f"({time.perf_counter() - start:.1f} s)\n", flush=True)
    groups = (("fitted shapes", CASES), ("held-out shapes", HELD_OUT), ("expert paths and 4-bit experts", EXPERT_PATHS))
    for label, names in ((label, {c.name for c in group}) for label, group in groups):
        ratios = [r["estimate"]["peak"] / r["measured"]["peak"] - 1 for r in results if r["case"] in names]
        if ratios:
            print(f"peak, estimate vs measured, {label} ({len(ratios)} cases): {min(ratios):+.1%} ... {max(ratios):+.1%}")
    print()
    shipped_estimates()
    print(json.dumps({r["case"]: {k: [r["estimate"][k], r["measured"][k]] for k in r["estimate"]} for r in results}))


def shipped_estimates() -> None:
    """What validate prints for the shipped 0.3B recipes (released config, on a GPU; estimates only)."""
    import os

    from erniekit_lite import recipe as recipes
    from erniekit_lite.plan import without_gpu_settings
    from erniekit_lite.run_plan import architecture, memory_estimate
    from erniekit_lite.trainer_args import training_args
    from erniekit_lite import memory

    shared = Path(os.environ.get("ERNIEKIT_SHARED", ROOT.parent / "shared")) / "ernie45" / "ernie-4.5-0.3b-base-pt"
    if not shared.is_dir():
        return
    print("Shipped recipes on the released ERNIE-4.5-0.3B config (estimates, as validate prints them for a CUDA GPU):")
    for name in ("sft.yaml", "sft-lora.yaml", "dpo.yaml", "dpo-lora.yaml"):
        recipe = recipes.load(ROOT / "recipes" / "ernie-4.5-0.3b" / name, [f"model.path={shared}"])
        args = training_args(without_gpu_settings(recipe), Path(recipe.output.dir))
        est, run = memory_estimate(recipe, args, architecture(str(shared), recipe), cuda=False)
        print(f"{name}:")
        for line in memory.format_lines(est, run, memory.smallest_gpu(est.total)):
            print(f"  {line.strip()}")
    print()


if __name__ == "__main__":
    main()
