"""`erniekit-lite prune`: an ERNIE 4.5 MoE cut to the K experts per layer that a data set routes to, and/or any ERNIE
4.5 cut to the L decoder layers that matter most on it (`--layers`: `LayerInfluence`, `depth_cut`; docs/prune.md).

    erniekit-lite prune RUN_OR_MODEL [--experts K] [--layers L] --out DIR [--data FILE] [--top-k N] [--report GRID] [--eval FILE]

1. Measure. The data goes through the pipeline training used (`data.prepare`: the run's recipe settings and the
   template its tokenizer carries; a model dir gets `eval --data`'s defaults) and is scored once by the model (a LoRA
   run merged first). A hook on each MoE layer's router reads what the router returns: the experts each token picks
   (top-k of the softmax over all experts plus `e_score_correction_bias`) and the weights its experts' outputs are
   mixed with (those experts' probabilities divided by their sum). An expert's routing weight in a layer is the sum
   of those weights over every token of the data (prompt and answer tokens alike): an expert never picked weighs 0,
   and a layer's total is its token count.
2. Cut. Per layer the K experts of most routing weight are kept (ties: the lower index), in their original order;
   the others are dropped from the fused expert weights (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`
   [E, H, I]), the router's rows (`mlp.gate.weight` [E, H]) and the correction bias (`[1, E]`). The config gets
   `moe_num_experts: K` (and `moe_k: N` with `--top-k`); nothing else is sized by the expert count.
3. Check and write. The cut model scores the data again; a hook on each cut router runs the original router on the
   same input and counts the tokens that now pick an expert the original did not pick for them. A token that picked
   a dropped expert must change. So can one that did not: the softmax now runs over the kept experts only, so their
   probabilities grow by 1 / (the kept experts' probability mass), while the correction bias added to them before
   top-k stays the same; a bias that separated two experts by more than their probability did may no longer
   (`--top-k` below the model's also changes choices). With a zero bias and dropped experts no token picked, the
   choice and the mixing weights are the original's (the weights are normalised over the picked experts, so the
   common factor cancels), and so are the logits. The model, tokenizer, chat template, generation config and
   `erniekit_pruned.json` (kept experts, shares and changes per layer) are written to a folder beside `--out` and
   renamed when complete.

`--report "layers=L1,.. experts=K1,.. top-k=N1,.."`: held-out loss (`eval --data`'s computation) of the original and
of every point of the grid (the product of the axes; an axis left out stays at the cut written, and `K1,K2,...` alone
means `experts=K1,K2,...`), one scoring pass per point, each cut as the written model would be (the same measured
routing and influence), as a Markdown table `OUT.report.md` and a plot of loss against bf16 size `OUT.report.png`,
beside `--out`. Held out: `--eval FILE`, else the run's own `data.eval` / `data.eval_split`.

Tensors of the base checkpoint that the model class does not load (the released 21B-A3B's multi-token-prediction
block, `model.mtp_*`, which `merge` carries over) are not written: they were not measured or cut.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from erniekit_lite.errors import UserError
from erniekit_lite.files import replace_dir, staging_dir
from erniekit_lite import words

MARKER = "erniekit_pruned.json"  # written last: a dir holding it is a complete prune
ROUTING = "sum over tokens of the normalised top-k routing weight (the weight each expert's output is mixed with)"
INFLUENCE = ("mean over tokens of 1 - cos(a decoder layer's input hidden state, its output): how much the layer turns the "
             "residual stream (ShortGPT's block influence; one scoring pass for every layer)")


@dataclass
class Layer:
    index: int  # the decoder layer
    kept: list[int]  # original expert indices, ascending
    share: float  # of the layer's routing weight, on the measuring data
    changed: int = 0  # tokens whose choice changed (see `ChoiceChanges`)
    tokens: int = 0


@dataclass(frozen=True, order=True)
class Point:
    """One model of the --report grid: decoder layers kept, experts per MoE layer, top-k (None: a dense model)."""
    layers: int
    experts: int | None
    top_k: int | None

    def __str__(self) -> str:
        return words.count(self.layers, "layer") + (f", {words.count(self.experts, 'expert')}, top-{self.top_k}" if self.experts else "")


@dataclass
class Result:
    experts: int
    top_k: int
    layers: list[Layer]
    parameters: int
    loss: float | None = None  # on the data it was scored on

    @property
    def changed(self) -> float:
        return sum(la.changed for la in self.layers) / max(1, sum(la.tokens for la in self.layers))


def prune(source: str, experts: int | None, out: str, data: str | None = None, top_k: int | None = None,
          report: str | None = None, eval_data: str | None = None, overwrite: bool = False, batch_size: int = 8,
          layers: int | None = None, log=print) -> dict:
    """Measure `source` over the data, keep `experts` experts per MoE layer and/or the `layers` decoder layers that
    matter most, write the model to `out`; returns what `erniekit_pruned.json` holds."""
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1 (got {batch_size})")
    if experts is None and layers is None:
        raise UserError("prune: give --experts K (routed experts kept per MoE layer), --layers L (decoder layers kept), or both")
    if top_k is not None and experts is None:
        raise UserError("--top-k: goes with --experts")
    target = Path(out)
    report_files = [target.with_name(f"{target.name}.report{ext}") for ext in (".md", ".png")] if report else []
    check_out(source, target, report_files, overwrite)
    config = model_config(source, need_moe=experts is not None)
    if experts is not None:
        check_experts(experts, top_k, config, "--experts")
    if layers is not None:
        check_layers(layers, config)
    points = report_points(report, config, layers, experts, top_k, log)
    measured, held_out = data_sections(source, data, eval_data, bool(report))

    from erniekit_lite.data.prepare import prepare
    from erniekit_lite.model.load import load_tokenizer
    from erniekit_lite.model.source import tokenizer_path

    tokenizer = load_tokenizer(tokenizer_path(source))
    prepared = prepare(measured, tokenizer, log=log)
    held_rows = None
    if report:
        held_rows = prepare(held_out, tokenizer, log=log).train.rows if held_out is not None else prepared.eval.rows
        if not held_rows:
            raise UserError("--report: the held-out data holds no samples to score; give --eval FILE")
    top_k = top_k or getattr(config, "moe_k", None)
    # The model and the report are written into one staging folder of this call's own, so a failure anywhere leaves
    # the earlier prune and its report as they were; both move into place only once both are whole
    work = staging_dir(target, "pruning")
    try:
        staging = work / "model"
        summary, table = _prune(source, experts, top_k, layers, points, config, measured, prepared, held_rows, tokenizer,
                                batch_size, staging, log)
        if table is not None:
            write_report(table, [work / p.name for p in report_files], source)
        replace_dir(staging, target)
        if table is not None:
            for p in report_files:
                os.replace(work / p.name, p)
            log(f"prune --report: wrote {report_files[0]} and {report_files[1]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)  # nothing half-written is left beside --out
    log(f"prune: wrote {target}: loads with AutoModelForCausalLM.from_pretrained({str(target)!r})")
    return summary


def _prune(source, experts, top_k, layers, points, config, measured, prepared, held_rows, tokenizer, batch_size, staging, log):
    """Measure, cut, check and write into `staging`; (the summary, the --report table or None)."""
    from erniekit_lite.evaluate import score_rows

    rows = prepared.train.rows
    with loaded(source, staging.parent, log) as model:
        total = config.num_hidden_layers
        moe = config.model_type == "ernie4_5_moe"
        weights = RoutingWeight(model) if experts is not None or (moe and points) else None
        influence = LayerInfluence(model) if layers is not None or any(p.layers < total for p in points) else None
        with weights or contextlib.nullcontext(), influence or contextlib.nullcontext():
            nll, tokens = score_rows(model, rows, batch_size, measured.max_length)
        before = Result(getattr(config, "moe_num_experts", 0), getattr(config, "moe_k", 0), [], parameters(model), nll / tokens)
        result = Result(experts or before.experts, top_k or before.top_k, weights.layers_for(experts) if experts else [], 0)
        kept_layers = influence.kept(layers) if layers else list(range(total))
        with cut(model, result if experts else None, kept_layers if layers else None):
            nll, _ = score_rows(model, rows, batch_size, measured.max_length)
            result.loss, result.parameters = nll / tokens, parameters(model)
            model.config.use_cache = True  # the loader turns the cache off for packed rows; inference wants it
            model.save_pretrained(staging, max_shard_size="5GB")
            model.config.use_cache = False
        result.layers = [la for la in result.layers if la.index in kept_layers]  # the MoE layers the model still has
        if experts:
            log_layers(result, weights.tokens, log)
        if layers:
            influence.log(kept_layers, log)
        log(f"prune: parameters {before.parameters:,} -> {result.parameters:,}; bf16 size {_size(2 * before.parameters)} -> "
            f"{_size(2 * result.parameters)}; loss on the measuring data {before.loss:.4f} -> {result.loss:.4f}")
        table = held_out_table(model, weights, influence, points, held_rows, batch_size, measured.max_length, log) if points else None
    tokenizer.save_pretrained(staging)
    spm = sentencepiece_model(source)
    if spm is not None and not (staging / "tokenizer.model").is_file():
        shutil.copy(spm, staging / "tokenizer.model")  # what llama.cpp's converter reads (`export --to gguf`)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(staging)
    summary = {
        "source": source,
        "data": [s.path for s in measured.train],
        "routing_weight": ROUTING,
        "experts_before": before.experts, "experts": result.experts, "top_k_before": before.top_k, "top_k": result.top_k,
        "layers_before": config.num_hidden_layers, "layers_kept": kept_layers, "layer_influence": INFLUENCE,
        "influence": influence.values() if layers else None,
        "parameters_before": before.parameters, "parameters": result.parameters,
        "bf16_bytes_before": 2 * before.parameters, "bf16_bytes": 2 * result.parameters,
        "tokens": (weights if experts else influence).tokens, "trained_tokens": tokens, "loss_before": before.loss, "loss": result.loss,
        "layers": [vars(la) for la in result.layers],
        "report": table,
    }
    (staging / MARKER).write_text(json.dumps(summary, indent=1) + "\n")
    return summary, table


# ---------------------------------------------------------------- inputs, checked before anything loads

def check_out(source: str, target: Path, report_files: list[Path], overwrite: bool) -> None:
    """A non-empty `--out` (or an existing report beside it) only with --overwrite, and only over a previous prune."""
    if target.resolve() == Path(source).resolve():
        raise UserError(f"--out {target}: is the model itself; choose a new directory for the pruned model")
    if target.exists() and not target.is_dir():
        raise UserError(f"--out {target}: is a file; choose a new directory for the pruned model")
    taken = [str(p) for p in report_files if p.exists()]
    if (target.is_dir() and any(target.iterdir())) or taken:
        if not overwrite:
            what = f"{target}: not empty" if not taken else f"{taken[0]}: exists"
            raise UserError(f"{what}; choose a new --out, or --overwrite (nothing was written)")
        if target.is_dir() and any(target.iterdir()) and not (target / MARKER).is_file():
            raise UserError(f"{target}: not empty and not a previous prune; --overwrite only replaces a pruned model (nothing was written)")


def model_config(source: str, need_moe: bool):
    """The source's model config (a LoRA run's base); a one-line error when it is no ERNIE 4.5 (MoE, for `need_moe`)."""
    from erniekit_lite.evaluate import check_model_path
    from erniekit_lite.model.source import adapter_base, check_source
    from erniekit_lite.model.reward import refuse_reward_run

    check_model_path(source)
    refuse_reward_run(source, "prune")
    path = adapter_base(source) or source
    check_source(path)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: could not read the model config: {str(e).strip().splitlines()[0]}") from None
    if need_moe and config.model_type != "ernie4_5_moe":
        raise UserError(f"{source}: {words.a(config.model_type)} model has no routed experts to prune; --experts takes an ERNIE 4.5 "
                        "MoE (ernie4_5_moe), and --layers cuts a dense model too")
    if config.model_type not in ("ernie4_5", "ernie4_5_moe"):
        raise UserError(f"{source}: {words.a(config.model_type)} model; prune takes ERNIE 4.5 (ernie4_5, ernie4_5_moe)")
    return config


def check_layers(layers: int, config) -> None:
    total = config.num_hidden_layers
    if not 1 <= layers < total:
        raise UserError(f"--layers {layers}: must be from 1 to {total - 1} (the model has {total} decoder layers)")


def check_experts(experts: int, top_k: int | None, config, flag: str) -> None:
    """K experts per layer: at least the experts each token picks, at most the model's."""
    total, picks = config.moe_num_experts, top_k or config.moe_k
    if top_k is not None and top_k < 1:
        raise UserError(f"--top-k {top_k}: each token must pick at least 1 expert")
    if experts < 1 or experts > total:
        raise UserError(f"{flag} {experts}: must be from {picks} (the experts each token picks) to {total} (moe_num_experts)")
    if experts < picks:
        raise UserError(f"{flag} {experts}: below top-k {picks} ({'--top-k' if top_k else 'moe_k'}): each token picks "
                        f"{picks} experts; keep at least {picks}, or lower --top-k")


AXES = ("layers", "experts", "top-k")
GRID = 'e.g. "layers=24,20 experts=32,16 top-k=6,4"'


def report_points(report: str | None, config, layers: int | None, experts: int | None, top_k: int | None, log) -> list[Point]:
    """The --report grid: `axis=v1,v2,...` parts separated by spaces (`K1,K2,...` alone: the experts axis); an axis
    left out stays at the cut written (--layers, --experts, --top-k; else the model's). Points whose top-k exceeds
    their expert count are left out (logged); values outside the model are one-line errors."""
    if report is None:
        return []
    text = report.strip()
    if text and all(c.isdigit() or c == "," for c in text):
        text = f"experts={text}"
    moe = config.model_type == "ernie4_5_moe"
    axes: dict[str, list[int]] = {}
    for part in text.split():
        name, _, values = part.partition("=")
        if name not in AXES or name in axes:
            why = f"{name} given twice" if name in axes else f"expected {', '.join(a + '=' for a in AXES)} followed by numbers"
            raise UserError(f"--report {part}: {why}, {GRID} (K1,K2,... alone: experts)")
        try:
            axes[name] = sorted({int(v) for v in values.split(",")}, reverse=True)
        except ValueError:
            raise UserError(f"--report {part}: expected numbers separated by commas, {GRID}") from None
        if name != "layers" and not moe:
            raise UserError(f"--report {part}: {words.a(config.model_type)} model has no routed experts; its grid is layers=...")
    if not axes:
        raise UserError(f"--report: empty; give a grid, {GRID}")
    total = config.num_hidden_layers
    for n in axes.get("layers", []):
        if not 1 <= n <= total:
            raise UserError(f"--report layers={n}: must be from 1 to {total} (the model's decoder layers)")
    if not moe:
        return [Point(n, None, None) for n in axes.get("layers", [layers or total])]
    all_experts = config.moe_num_experts
    picks = axes.get("top-k", [top_k or config.moe_k])
    for k in picks:
        if not 1 <= k <= all_experts:
            raise UserError(f"--report top-k={k}: must be from 1 to {all_experts} (moe_num_experts)")
    for e in axes.get("experts", []):
        if not 1 <= e <= all_experts:
            raise UserError(f"--report experts={e}: must be from 1 to {all_experts} (moe_num_experts)")
        if e < min(picks):
            raise UserError(f"--report experts={e}: below top-k {min(picks)}: each token picks {min(picks)} experts; "
                            f"keep at least {min(picks)}, or lower top-k")
    grid = itertools.product(axes.get("layers", [layers or total]), axes.get("experts", [experts or all_experts]), picks)
    points = [Point(*p) for p in grid]
    left_out = [p for p in points if p.top_k > p.experts]
    if left_out:
        log(f"prune --report: left out (top-k above the experts kept): {'; '.join(map(str, left_out))}")
    return sorted((p for p in points if p not in left_out), reverse=True)


def data_sections(source: str, data: str | None, eval_data: str | None, report: bool):
    """(the data to measure routing on, the held-out data for --report or None: the run's own eval split)."""
    from erniekit_lite.evaluate import resolve

    recipe_file = Path(source) / "recipe.yaml"
    run = recipe_file.is_file()
    held = resolve(str(recipe_file) if run else source, eval_data, None)[1] if eval_data else None
    if data is not None:
        measured = resolve(str(recipe_file) if run else source, data, None)[1]
    elif not run:
        raise UserError(f"--data: {source} is a model, not a run; give the data to measure its routing on with --data FILE")
    else:
        from erniekit_lite import recipe as recipes

        recipe = recipes.load(str(recipe_file))
        if recipe.method != "sft":
            raise UserError(f"--data: {source} is a {recipe.method} run, whose training data holds no conversations "
                            "to score; give the data to measure routing on with --data FILE")
        measured = recipe.data
    if report and held is None and not (run and data is None and (measured.eval or measured.eval_split)):
        raise UserError("--report: needs held-out data: --eval FILE (a run trained with data.eval or data.eval_split "
                        "uses that when --data is not given)")
    if not report or held is not None:
        measured = measured.model_copy(update={"eval": []})  # its held-out sources are not scored: not prepared
    return measured, held


@contextlib.contextmanager
def loaded(source: str, scratch: Path, log):
    """The model in eval mode, in its checkpoint's dtype, a LoRA run merged into its base (QLoRA through `merge`,
    into the base it trained against), on the GPU when there is one."""
    import torch

    from erniekit_lite.model.attention import NAME
    from erniekit_lite.model.load import load_model
    from erniekit_lite.model.source import adapter_base
    from erniekit_lite.model.merge import base_dtype, merge, trained_in_4bit

    base = adapter_base(source)
    with contextlib.ExitStack() as stack:
        path = source
        if base is not None and trained_in_4bit(source):
            path = str(Path(stack.enter_context(tempfile.TemporaryDirectory(dir=scratch, prefix=".prune-merge-"))) / "merged")
            log(f"prune: merging the QLoRA run {source} into its dequantized base first")
            merge(source, path, log=log)
        model = load_model(path, base_dtype(base or path), NAME, trainable_adapter=False)
        if hasattr(model, "merge_and_unload"):
            model = model.merge_and_unload()
        if torch.cuda.is_available():
            model = model.to("cuda")
        yield model.eval()


def sentencepiece_model(source: str) -> Path | None:
    """The sentencepiece `tokenizer.model` of the run, its base or its recipe's model, when there is one."""
    from erniekit_lite.export import sentencepiece_model as find
    from erniekit_lite.model.source import adapter_base

    try:
        return find(Path(source), adapter_base(source))
    except UserError:
        return None


# ---------------------------------------------------------------- routing, cutting, checking

def moe_blocks(model) -> list[tuple[int, object]]:
    """(decoder layer index, sparse MoE block) of each MoE layer, in order."""
    return [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


class _RouterHooks:
    """Forward hooks on the MoE routers while in a `with` block; removed on leaving it."""

    _hooks: list

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class RoutingWeight(_RouterHooks):
    """Inside `with`: each MoE layer's routing weight per expert, from the router's own output (chosen experts and
    their normalised weights), summed over every token the model sees."""

    def __init__(self, model):
        import torch

        self.blocks = moe_blocks(model)
        self.weight = [torch.zeros(b.gate.num_experts, dtype=torch.float64, device=b.gate.weight.device) for _, b in self.blocks]
        self.tokens = 0  # routed by each MoE layer
        self._hooks = []

    def __enter__(self):
        for n, ((_, block), weight) in enumerate(zip(self.blocks, self.weight)):
            def add(module, args, output, weight=weight, first=n == 0):
                _, mixed, chosen = output  # (logits, [T, k] weights, [T, k] expert indices)
                weight.index_add_(0, chosen.reshape(-1), mixed.reshape(-1).to(weight.dtype))
                if first:
                    self.tokens += chosen.shape[0]

            self._hooks.append(block.gate.register_forward_hook(add))
        return self

    def layers_for(self, experts: int) -> list[Layer]:
        """The `experts` experts of most weight per layer (ties: the lower index), ascending, with their share."""
        import torch

        out = []
        for (index, _), weight in zip(self.blocks, self.weight):
            order = sorted(range(len(weight)), key=lambda e: (-float(weight[e]), e))
            kept = sorted(order[:experts])
            total = float(weight.sum())
            share = float(weight[torch.tensor(kept, device=weight.device)].sum()) / total if total else 1.0
            out.append(Layer(index, kept, share))
        return out


@contextlib.contextmanager
def pruned(model, result: Result):
    """The model cut to `result`'s experts per layer and its top-k, in place; restored on leaving."""
    import torch

    config = model.config
    saved_config = (config.moe_num_experts, config.moe_k, model.num_experts, model.num_experts_per_tok)
    saved = []
    for (_, block), layer in zip(moe_blocks(model), result.layers):
        gate, experts = block.gate, block.experts
        statics = gate.moe_statics
        saved.append((block, gate.weight, statics.e_score_correction_bias, experts.gate_up_proj, experts.down_proj,
                      gate.num_experts, gate.top_k, block.num_experts, block.top_k, experts.num_experts))
        kept = torch.tensor(layer.kept, device=gate.weight.device)
        gate.weight = _cut(gate.weight, kept, 0)  # [E, H] rows
        statics.e_score_correction_bias = _cut(statics.e_score_correction_bias, kept, 1)  # [1, E]
        experts.gate_up_proj = _cut(experts.gate_up_proj, kept, 0)  # [E, 2I, H]
        experts.down_proj = _cut(experts.down_proj, kept, 0)  # [E, H, I]
        gate.num_experts = block.num_experts = experts.num_experts = result.experts
        gate.top_k = block.top_k = result.top_k
    config.moe_num_experts = model.num_experts = result.experts
    config.moe_k = model.num_experts_per_tok = result.top_k
    try:
        yield model
    finally:
        for (block, weight, bias, gate_up, down, gate_n, gate_k, block_n, block_k, experts_n) in saved:
            block.gate.weight, block.gate.moe_statics.e_score_correction_bias = weight, bias
            block.experts.gate_up_proj, block.experts.down_proj = gate_up, down
            block.gate.num_experts, block.gate.top_k, block.num_experts, block.top_k = gate_n, gate_k, block_n, block_k
            block.experts.num_experts = experts_n
        config.moe_num_experts, config.moe_k, model.num_experts, model.num_experts_per_tok = saved_config


def _cut(param, kept, dim: int):
    import torch

    return torch.nn.Parameter(param.data.index_select(dim, kept).contiguous(), requires_grad=False)


class ChoiceChanges(_RouterHooks):
    """Inside `with`, entered before `pruned` cuts the model: per MoE layer, the tokens that pick an expert the
    original router did not pick for them from the same input (a copy of the original router runs beside the cut one)."""

    def __init__(self, model, result: Result):
        self.result = result
        self.blocks = moe_blocks(model)
        self._hooks = []

    def __enter__(self):
        import torch

        for (_, block), layer in zip(self.blocks, self.result.layers):
            kept = torch.tensor(layer.kept, device=block.gate.weight.device)
            original = copy.deepcopy(block.gate)  # small: [E, H] rows and the bias

            def count(module, args, output, original=original, kept=kept, layer=layer):
                before = original(args[0])[2]  # [T, k] original expert indices
                after = kept[output[2]]  # the cut router's picks, as original indices
                new = (after[:, :, None] != before[:, None, :]).all(-1).any(-1)
                layer.changed += int(new.sum())
                layer.tokens += new.numel()

            self._hooks.append(block.gate.register_forward_hook(count))
        return self


class LayerInfluence:
    """Inside `with`: each decoder layer's influence (INFLUENCE) over every token the model sees. A layer that leaves
    its input as it is scores 0 and is the first to go. One pass measures every layer; skipping each layer in turn
    and scoring the loss would take a pass per layer."""

    def __init__(self, model):
        import torch

        self.layers = list(model.model.layers)
        self.sums = [torch.zeros((), dtype=torch.float64) for _ in self.layers]
        self.tokens = 0
        self._hooks = []

    def __enter__(self):
        import torch.nn.functional as F

        for n, layer in enumerate(self.layers):
            def add(module, args, kwargs, output, n=n):
                before = args[0] if args else kwargs["hidden_states"]
                after = output[0] if isinstance(output, tuple) else output
                turned = 1 - F.cosine_similarity(before.float(), after.float(), dim=-1)
                self.sums[n] += turned.double().sum().cpu()
                if n == 0:
                    self.tokens += turned.numel()

            self._hooks.append(layer.register_forward_hook(add, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def values(self) -> list[float]:
        return [float(s) / max(1, self.tokens) for s in self.sums]

    def kept(self, layers: int) -> list[int]:
        """The `layers` layers of most influence (ties: the lower index), in their order."""
        values = self.values()
        return sorted(sorted(range(len(values)), key=lambda i: (-values[i], i))[:layers])

    def log(self, kept: list[int], log) -> None:
        log(f"prune: kept {len(kept)} of {len(self.layers)} decoder layers; influence = {INFLUENCE}, over {self.tokens:,} tokens")
        log("  layer  influence  kept")
        for i, value in enumerate(self.values()):
            log(f"  {i:>5}  {value:>9.4f}  {'yes' if i in kept else 'no'}")


def moe_placement(config, kept: list[int]) -> tuple[int, int] | None:
    """(moe_layer_start_index, moe_layer_end_index) that make exactly the kept MoE layers MoE after the cut, with
    moe_layer_interval 1; None for a dense model. transformers places MoE layers by those three numbers only, so a
    kept dense layer after a kept MoE layer cannot be expressed: a one-line error."""
    if not hasattr(config, "moe_layer_start_index"):
        return None
    interval, start, end = config.moe_layer_interval, config.moe_layer_start_index, config.moe_layer_end_index
    is_moe = [(i + 1) % interval == 0 and start <= i <= end for i in kept]
    first = is_moe.index(True) if any(is_moe) else len(kept)
    if not all(is_moe[first:]):
        dense = next(kept[i] for i in range(first, len(kept)) if not is_moe[i])
        raise UserError(f"--layers {len(kept)}: the layers kept ({', '.join(map(str, kept))}) put the dense layer {dense} after "
                        "an MoE layer, which moe_layer_start_index / end_index / interval cannot say; keep more or fewer layers")
    return first, len(kept) - 1


@contextlib.contextmanager
def cut(model, result: Result | None, kept: list[int] | None):
    """The model cut in place to `result`'s experts and top-k (choices counted against the original router) and/or
    to its decoder layers `kept`, as the written model is; restored on leaving."""
    with contextlib.ExitStack() as stack:
        if result is not None:
            stack.enter_context(ChoiceChanges(model, result))
            stack.enter_context(pruned(model, result))
        if kept is not None:
            stack.enter_context(depth_cut(model, kept))
        yield model


@contextlib.contextmanager
def depth_cut(model, kept: list[int]):
    """The model cut to its decoder layers `kept`, renumbered, with the config to match; restored on leaving."""
    import torch

    config, decoder = model.config, model.model
    placement = moe_placement(config, kept)
    keys = ("num_hidden_layers", "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval")
    saved_config = {k: getattr(config, k) for k in keys if hasattr(config, k)}
    saved_layers = decoder.layers
    decoder.layers = torch.nn.ModuleList([saved_layers[i] for i in kept])
    for new, layer in enumerate(decoder.layers):
        layer.self_attn.layer_idx = new  # its KV cache slot in generation
    config.num_hidden_layers = len(kept)
    if placement is not None:
        config.moe_layer_start_index, config.moe_layer_end_index = placement
        config.moe_layer_interval = 1
    try:
        yield model
    finally:
        decoder.layers = saved_layers
        for old, layer in enumerate(saved_layers):
            layer.self_attn.layer_idx = old
        for key, value in saved_config.items():
            setattr(config, key, value)


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied LM head counted once


# ---------------------------------------------------------------- output

def log_layers(result: Result, tokens: int, log) -> None:
    log(f"prune: kept {result.experts} experts per MoE layer (top-{result.top_k}); routing weight = {ROUTING}, over {tokens:,} tokens")
    log("  layer  routing weight kept  tokens picking an expert the original did not")
    for la in result.layers:
        log(f"  {la.index:>5}  {la.share:>19.1%}  {la.changed:,} of {la.tokens:,} ({la.changed / max(1, la.tokens):.1%})")


def held_out_table(model, weights: RoutingWeight | None, influence: LayerInfluence | None, points: list[Point], rows,
                   batch_size: int, max_length: int, log) -> dict:
    """The held-out loss of the original and of each point, cut in place by the measured routing and influence as
    the written model is; a depth the config cannot place (`moe_placement`) is listed without a loss."""
    from erniekit_lite.evaluate import score_rows

    config = model.config
    moe = weights is not None
    nll, tokens = score_rows(model, rows, batch_size, max_length)
    entries = [{"layers": config.num_hidden_layers, "experts": config.moe_num_experts if moe else None,
                "top_k": config.moe_k if moe else None, "original": True, "parameters": parameters(model), "loss": nll / tokens,
                "share_min": 1.0 if moe else None, "share_mean": 1.0 if moe else None, "changed": 0.0 if moe else None}]
    for point in points:
        kept = influence.kept(point.layers) if point.layers < config.num_hidden_layers else list(range(config.num_hidden_layers))
        entry = {**vars(point), "original": False, "kept_layers": kept, "parameters": None, "loss": None,
                 "share_min": None, "share_mean": None, "changed": None}
        entries.append(entry)
        try:
            moe_placement(config, kept)
        except UserError as e:
            entry["note"] = "not written: a dense layer after an MoE layer"
            log(f"prune --report: {point}: left out: {e}")
            continue
        result = Result(point.experts, point.top_k, weights.layers_for(point.experts), 0) if moe else None
        with cut(model, result, kept):
            nll, _ = score_rows(model, rows, batch_size, max_length)
            entry.update(parameters=parameters(model), loss=nll / tokens)
        if moe:
            shares = [la.share for la in result.layers if la.index in kept]
            entry.update(share_min=min(shares, default=None), share_mean=sum(shares) / len(shares) if shares else None,
                         changed=result.changed)
        log(f"prune --report: {point}: held-out loss {nll / tokens:.4f}")
    return {"tokens": tokens, "rows": entries}


def report_markdown(table: dict, source: str) -> str:
    rows = table["rows"]
    base, moe = rows[0], rows[0]["experts"] is not None
    head = ["layers", *(["experts per layer", "top-k"] if moe else []), "parameters", "bf16 size",
            *(["routing weight kept (mean / min layer)", "tokens picking a new expert"] if moe else []), "held-out loss", "vs original"]
    lines = [(f"Held-out loss of {source} and of it cut (`eval --data`'s loss, over {table['tokens']:,} trained tokens)"
              + ("; routing weight kept: on the data the experts were chosen by, over the MoE layers kept; tokens picking "
                 "a new expert: on the held-out data, all MoE layers kept together." if moe else ".")), "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [f"{r['layers']} (original)" if r["original"] else str(r["layers"])]
        cells += [str(r["experts"]), str(r["top_k"])] if moe else []
        if r["loss"] is None:
            cells += [r["note"]] + [""] * (len(head) - len(cells) - 1)
        else:
            cells += [f"{r['parameters']:,}", _size(2 * r["parameters"])]
            if moe:
                share = "—" if r["share_mean"] is None else f"{r['share_mean']:.1%} / {r['share_min']:.1%}"
                cells += [share, f"{r['changed']:.1%}"]
            cells += [f"{r['loss']:.4f}", _change(r["loss"] - base["loss"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _change(difference: float) -> str:
    """A loss difference as the table prints it; no change (a difference that rounds to zero, or -0.0) is +0.0000."""
    return f"{round(difference, 4) + 0.0:+.4f}"  # + 0.0 turns round's -0.0 into 0.0


def write_report(table: dict, files: list[Path], source: str) -> None:
    markdown, plot = files
    markdown.write_text(report_markdown(table, source), encoding="utf-8")
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    rows = [r for r in table["rows"] if r["loss"] is not None]
    scale, unit = (1e9, "GB") if 2 * rows[0]["parameters"] >= 1e9 else (1e6, "MB")
    size = [2 * r["parameters"] / scale for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter(size[1:], [r["loss"] for r in rows[1:]], marker="o", label="cut")
    ax.scatter(size[:1], [rows[0]["loss"]], marker="*", s=120, label="original")
    front, best = [], float("inf")  # the cuts no smaller one beats: the choices worth making
    for x, r in sorted(zip(size, rows), key=lambda pair: (pair[0], pair[1]["loss"])):
        if r["loss"] < best:
            front.append((x, r["loss"]))
            best = r["loss"]
    ax.plot(*zip(*front), linestyle="--", linewidth=1, color="grey", label="lowest loss at its size or smaller")
    labels: dict[tuple, list[str]] = {}  # points that coincide (top-k does not change the size) share one label
    for x, r in zip(size, rows):
        name = f"L{r['layers']}" + (f" E{r['experts']} k{r['top_k']}" if r["experts"] is not None else "")
        labels.setdefault((x, round(r["loss"], 4)), []).append(name + (" (original)" if r["original"] else ""))
    for (x, y), names in labels.items():
        ax.annotate(", ".join(names), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.ticklabel_format(axis="both", useOffset=False)
    ax.set_xlabel(f"bf16 size ({unit})")
    ax.set_ylabel("held-out loss")
    ax.set_title("cut by depth (L layers)" + (" × experts per layer (E) × top-k (k)" if rows[0]["experts"] is not None else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(plot, dpi=100)
    plt.close(fig)


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
