"""Peak accelerator memory per device for a recipe: the estimate `erniekit-lite validate` prints.

Arithmetic on the model config, the parameters of the meta-device model with its LoRA adapters, and the recipe;
nothing is allocated. benchmarks/memory_check.py compares every component with measurements of tiny models on CPU
(saved-tensor bytes and a storage-level peak); tests/test_memory.py asserts the agreement.

    total = weights + gradients + optimizer + activations + logits + backward working set (+ DPO reference) + overhead

Notation: T tokens per micro-batch per device = per_device_train_batch_size x data.max_length (x2 for DPO, ORPO
and SimPO, whose rows hold whole pairs); h hidden, d head_dim, H heads, K kv_heads, I intermediate, V vocab, L
layers; for the MoE E experts, k top-k, m moe_intermediate, S = shared_experts x m; r = bytes of model.dtype (the residual stream),
b = bytes of matmul outputs (2 under bf16/fp16 autocast, else r).

- weights: each parameter in its dtype: model.dtype, the MoE router in fp32 (transformers keeps it there), LoRA
  adapters in fp32 (peft upcasts them) or bf16 under QLoRA (TRL casts them). model.load_in_4bit: bitsandbytes
  NF4 stores each nn.Linear weight in 0.516 B (4 bits + double-quantized scales), plus 1,092 B of code tables per
  quantized linear (checked against a loaded 4-bit model in tests/test_qlora.py), but leaves the LM head / tied
  embeddings, norms and the router in model.dtype. The MoE's fused routed-expert weights (3-D parameters, which
  bitsandbytes leaves) are NF4 too (model/expert_4bit.py): 0.516 B each, plus 1,088 B of code tables and 4 B per
  expert for each fused parameter.
- gradients: one per trainable parameter, in its dtype (Trainer's bf16 is autocast: no fp32 master copy).
- optimizer: AdamW (adamw_torch_fused, the default; any adam*): 2 states per trainable parameter in its dtype;
  *8bit optimizers 2 bytes; lion/rmsprop/adagrad 1 state; sgd and adafactor counted as none. train.ema adds
  4 bytes per trainable parameter (its fp32 copy).
- activations: what autograd saves in one training forward, per decoder layer and token:
      norms       2 x (4h + 4)            fp32 input (or its fp32 copy) and 1/rms; + r*h each when norms train
      attention   8d + b(H + 2K)d + b*H*d + 4H   rope cos/sin (fp32), q/k/v as attention sees them, output,
                                          logsumexp
      dense MLP   3b*I                    gate output, silu(gate), up output
      MoE MLP     3b*S + 4E + 28k + k*r*(3m + h)   shared experts, router probabilities/indices, routed experts'
                                          gate_up output, silu and down output (grouped_mm runs in r)
    plus the input of every linear that trains (all under full FT; the adapted ones under LoRA), one tensor per
    source: r*h for q/k/v, b*H*d for o_proj (flash attention shares it with the output), r*h for gate/up and
    the shared experts' gate/up, b*I (b*S) for down_proj, k*r*(h + m) for the routed experts, 4h for a trained
    router. A copy per linear when a cast makes one: fp32 weights under autocast (each linear keeps its own bf16
    input), fp32 LoRA adapters on a bf16 base (peft casts the input up, autocast back down), LoRA dropout (its
    output, plus the mask: 1 byte on CUDA). Each adapter adds its rank-r intermediate. Layer 0 keeps nothing for
    its first norm under LoRA without checkpointing (the embedding output needs no gradient).
    fp32 weights under autocast also keep the bf16 copy of every linear weight (2 bytes/param). LoRA on the
    routed experts (peft target_parameters) with `lora.expert_compute: merged` merges W + BA for each MoE layer
    in every forward and keeps it: one full copy of that layer's expert weights. `split` (the default,
    model/expert_lora.py) keeps instead k x r x (rank of gate_up + rank of down) per token, and each MoE layer's
    expert adapters' B densely in r (and A too when cast to r) from one optimizer step to the next, checkpointed or not.
    Activation checkpointing (TRL's default; activation_checkpointing_kwargs every_n_layers / offload honoured):
    a checkpointed layer keeps only its input, r*h per token (none on the device when offloaded), plus the rope
    cos/sin once, 8d.
- logits: the LM head runs only at the P trained positions, in chunks of C = min(P, MAX_CHUNK_ELEMENTS / V)
  (scoring.py), plus 8P for the targets. A frozen head (LoRA, QLoRA) keeps each position's gradient w.r.t. its
  hidden state, P*r*h, and no logits. A trained head (full FT) keeps each chunk's fp32 exp(logits - max), 4PV, and
  its input; or, when the plan says that does not fit (`head_keep` false), recomputes every chunk in backward and
  keeps the P scored hidden states (r*h) instead.
- working set, the larger of: the LM-head phase (frozen head: one chunk in forward, 4CV, + 2bCV with bf16 output,
  + 4CV for the preference methods' metrics, + 2Vh for autocast's copy of the head weight, made per call for a frozen weight;
  trained head: its weight gradient beside the kept softmax (computed in place), 8CV when chunks are recomputed,
  and with several chunks at least 3 x V x h gradient bytes: a chunk's head-weight gradient, the running sum, the new sum); the layer phase, one
  recomputed layer (with checkpointing) + a quarter of a layer's activations (gradients in flight; fitted to the
  measurements) + 2 x the layer's parameters in gradient bytes (full FT) + the merged expert stack's gradient
  (expert LoRA, merged), less the trained head's kept buffers, freed by then. QLoRA's layer phase adds the larger of
  the largest 4-bit linear dequantized (x2, bf16) and the routed experts' largest run (model/expert_4bit.py: every
  expert's rows of one run dequantized, 2.56 B per element, plus with several runs 6 B per routed token and input
  feature in backward); its LM-head phase nothing (the tied head is not quantized).
- DPO (ORPO and SimPO have no reference): LoRA DPO's reference is the base with the adapter disabled: its no-grad
  forward (one layer's activations, or one logits chunk at (8 + b) x CV) counts where it exceeds the working set. Full DPO adds a frozen
  copy of the model (not with precompute_ref_log_probs). Not yet measured. KTO: the same reference; T counts one
  side (data.max_length per row: the examples, scored with grad), since its KL twins and reference passes run
  without grad, the policy's KL pass before its own forward (nothing extra at the peak).
- GRPO: T = per_device_train_batch_size x (data.max_length + max_completion_length) (a packed row of prompts and
  completions), P = per_device_train_batch_size x max_completion_length; the reference as DPO's (when beta > 0).
  Generation (transformers' `generate`) holds the KV cache of the device's generation batch, n sequences of up to
  data.max_length + max_completion_length tokens, 2LKd x b bytes per token, plus n x V x (b + 8) for the last
  position's logits, while the training activations are freed: the peak takes the larger of the two phases,
      total = weights + gradients + optimizer (+ reference copy) + max(training, generation) + overhead.
  Not yet measured; with vLLM in server mode generation runs on the server's GPUs (0 here).
- overhead: 0.5 GiB (CUDA context, cuBLAS workspace: outside PyTorch's allocator) + 10% of the rest (caching-
  allocator fragmentation). An assumption, not measured on a GPU yet.

train.offload (train/offload.py) moves state to host memory, counted as `host` per process: `optimizer` keeps on the
host an fp32 master, an fp32 gradient copy and the optimizer's fp32 states per trainable parameter (8 + 4 x states
bytes; the device drops its optimizer states); `parameters` (FSDP2's CPU offload over N processes) keeps there every
weight, gradient and state, (trainable x t x (2 + states) + frozen weights) / N with t = 4 under autocast (accelerate
makes the trainable parameters fp32) else the trained dtype, and the device holds only three decoder layers and the
root unit (embedding, tied head) in the compute dtype, with no gradients or states. Checked against the bytes the
runs hold in tests/test_offload.py.

Gradients are counted as fully allocated while all activations are alive: exact with gradient_accumulation_steps
> 1 (the shipped recipes), an upper bound with 1. Sharded runs (FSDP / ZeRO-3): `sharded_total`, rough.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Logits per LM-head chunk (train/scoring.py scores in chunks of at most this many): 512 MiB in fp32, about 1,300
# positions of a 103k vocabulary. Measured on CPU, larger chunks run the head's matmuls faster (1.2-1.5x over 128
# positions at hidden 256-1024), and the frozen path keeps no chunk.
MAX_CHUNK_ELEMENTS = 2**27

GIB = 2**30
GPUS_GB = (24, 48, 80, 141)  # the GPU memory sizes validate names (RTX 4090 / L40S / A100-H100 / H200)
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit weight, 8-bit absmax per 64, fp32 scale per 256 absmax blocks
NF4_MODULE_BYTES = 16 * 4 + 256 * 4 + 4  # per quantized linear: the NF4 code, the absmax's 8-bit code, its offset
CONTEXT_BYTES = GIB // 2  # CUDA context + cuBLAS workspace: outside PyTorch's allocator
FRAGMENTATION = 0.10  # the caching allocator reserves more than it hands out
ADAM_LIKE = ("adamw", "adam", "ademamix", "lomo", "adalomo", "galore", "apollo", "grokadamw", "stable_adamw", "schedule_free_adamw")


@dataclass(frozen=True)
class Shape:
    """The architecture numbers the activation formula reads (from the model config)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    shared_experts: int = 0
    moe_layers: frozenset[int] = frozenset()

    @classmethod
    def from_config(cls, config) -> Shape:
        config = config.get_text_config()  # ERNIE-4.5-VL: its language model (the vision encoder is planned apart)
        heads = config.num_attention_heads
        shape = dict(
            hidden=config.hidden_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
        )
        experts = getattr(config, "moe_num_experts", 0) or 0
        if experts:
            if getattr(config, "mlp_layer_types", None):  # ERNIE-4.5-VL names each layer's kind
                moe = frozenset(i for i, kind in enumerate(config.mlp_layer_types) if kind == "sparse")
            else:  # the same rule as Ernie4_5_MoeDecoderLayer
                start, end = config.moe_layer_start_index, config.moe_layer_end_index
                interval = config.moe_layer_interval
                moe = frozenset(i for i in range(shape["layers"]) if (i + 1) % interval == 0 and start <= i <= end)
            shape.update(
                experts=experts,
                top_k=config.moe_k,
                # ERNIE-4.5-VL: [text experts' width, vision experts'] (the text experts planned; the vision ones are narrower)
                moe_intermediate=config.moe_intermediate_size if isinstance(config.moe_intermediate_size, int) else config.moe_intermediate_size[0],
                shared_experts=getattr(config, "moe_num_shared_experts", 0) or 0,
                moe_layers=moe,
            )
        return cls(**shape)


@dataclass(frozen=True)
class Params:
    """What the parameters of the model to train cost and which of them train (see `params_of`)."""

    linear: int  # frozen nn.Linear weights other than the LM head: the ones 4-bit would quantize
    fp32: int  # frozen parameters transformers keeps in fp32 (the MoE router)
    other: int  # other frozen parameters: embeddings, norms, fused routed experts
    trainable: int
    trained: frozenset[str]  # per-layer weights whose inputs autograd keeps: "q_proj", ..., "norm", "router", "experts"
    lora: frozenset[str] = frozenset()  # per-layer modules with a LoRA adapter (subset of trained)
    lora_rank: dict = field(default_factory=dict)  # module -> rank of its adapter
    lora_dropout: float = 0.0
    expert_lora: bool = False  # routed experts adapted through peft target_parameters
    expert_split: bool = False  # ... computed per expert (model/expert_lora.py), not on merged weights per forward
    expert_params_per_layer: int = 0  # numel of one MoE layer's fused expert weights
    head_trains: bool = False  # the LM head / tied embedding trains (full fine-tuning)
    matmul_weights: int = 0  # numel of all nn.Linear weights incl. the LM head and adapters (autocast copies)
    largest_linear: int = 0  # numel of the largest quantizable linear (QLoRA dequantizes one at a time)
    layer_matmul_max: int = 0  # nn.Linear weights of the largest decoder layer
    layer_matmul_total: int = 0  # nn.Linear weights of all decoder layers
    linear_modules: int = 0  # how many linears `linear` counts (each 4-bit one has its own quantization tables)
    experts_frozen: int = 0  # frozen fused routed-expert weights (part of `other`; NF4 under load_in_4bit)
    expert_stacks: int = 0  # how many fused expert parameters those are (each 4-bit one has its own tables)
    experts_per_stack: int = 0  # E (each 4-bit stack keeps one absmax offset per expert)
    layer_params_max: int = 0  # all parameters of the largest decoder layer (what FSDP / ZeRO-3 gathers at once)


@dataclass(frozen=True)
class Run:
    """The recipe's settings that change memory."""

    tokens: int  # per micro-batch per device
    scored: int  # positions the LM head runs at (trained next tokens), <= tokens
    dtype_bytes: int = 4  # model.dtype
    autocast: bool = False  # train.bf16 / train.fp16
    load_in_4bit: bool = False
    checkpointing: bool = True
    every_n_layers: int = 1
    offload: bool = False
    attention: str = "flash"  # flash | sdpa (incl. packed_sdpa) | eager
    row_length: int = 0  # longest attention span (eager only)
    optim: str = "adamw_torch_fused"
    method: str = "sft"
    reference: str = "none"  # none | adapter (LoRA DPO: adapter disabled) | copy (full DPO) | precomputed
    chunk_elements: int = 2**27
    head_keep: bool = False  # a trained LM head keeps every chunk's buffer instead of recomputing (scoring.py)
    device: str = "cuda"  # cpu only for the calibration: CPU dropout keeps its mask in the input's dtype
    ema: bool = False  # train.ema: an fp32 copy of the trained parameters (train/ema.py)
    generate_sequences: int = 0  # GRPO: sequences transformers' generate runs at once on this device (0: none here)
    generate_length: int = 0  # GRPO: their longest prompt + completion
    host_offload: str = "none"  # train.offload as applied: none | optimizer | parameters (`offload` above is checkpointing's)
    processes: int = 1  # over which FSDP2 shards what `parameters` offloads
    sync: str = "every_step"  # distributed.sync of a multi-process DDP run: powersgd and local_sgd hold memory (sync_bytes)
    sequence_parallel: int = 1  # processes sharing each row's tokens: `tokens` and `scored` are already this process's share


@dataclass
class Estimate:
    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    transient: int
    reference: int
    overhead: int
    notes: list[str] = field(default_factory=list)
    four_bit: str = ""  # which parts are 4-bit, when load_in_4bit
    reference_copy: int = 0  # the frozen reference model of full-FT DPO (part of `reference`)
    generation: int = 0  # GRPO: KV cache and sampling logits of a generation batch (not alive with the activations)
    host: int = 0  # train.offload: what the offloaded state takes in host memory, per process
    sync: int = 0  # distributed.sync: kept for the whole run (PowerSGD's error feedback)
    sync_peak: int = 0  # distributed.sync: alive while the processes exchange (outside the forward's activations)

    @property
    def static(self) -> int:
        """What stays allocated through the step: weights, gradients, optimizer states, a frozen reference copy."""
        return self.weights + self.gradients + self.optimizer + self.reference_copy + self.sync

    @property
    def training(self) -> int:
        """The training forward/backward's own memory, freed before the next generation."""
        return self.activations + self.logits + self.transient + self.reference - self.reference_copy

    @property
    def total(self) -> int:
        return self.static + max(self.training, self.generation, self.sync_peak) + self.overhead


HOST_HELD = {  # what `train.offload` keeps in host memory (format_lines)
    "optimizer": "the fp32 master weights, their gradients and the optimizer states (the CPU runs the optimizer step)",
    "parameters": "the weights, gradients and optimizer states, sharded over the processes (FSDP2 CPU offload)",
}


def a_gpu(gb: int) -> str:
    """"a 24 GB GPU", "an 80 GB GPU": the article as the number is said."""
    return f"{'an' if str(gb)[0] == '8' or str(gb) in ('11', '18') else 'a'} {gb} GB GPU"


def size(n: int) -> str:
    """Bytes as GiB, or MiB below a tenth of one (a tiny model's host state)."""
    return f"{n / GIB:.1f} GiB" if n >= GIB // 10 else f"{n / 2**20:.1f} MiB"


def smallest_gpu(total: int) -> int | None:
    """The smallest listed GPU size (GB, as sold; compared in GiB) the estimate fits, or None."""
    for size in GPUS_GB:
        if total <= size * GIB:
            return size
    return None


# ---------------------------------------------------------------------------------------------------------------
# Parameters


def params_of(model, lora_dropout: float = 0.0) -> Params:
    """Classify the parameters of a (meta-device) model, optionally wrapped by peft, for `estimate`."""
    import torch

    from erniekit_lite.model.lora import unwrap

    base = unwrap(model)
    head = base.get_output_embeddings()
    head_ids = {id(head.weight)} if head is not None else set()
    linear_ids, largest = set(), 0
    for name, module in base.named_modules():
        if type(module) is torch.nn.Linear and id(module.weight) not in head_ids and not _is_lora_factor(name):
            linear_ids.add(id(module.weight))
            largest = max(largest, module.weight.numel())
    linear = fp32 = other = trainable = experts_frozen = stacks = per_stack = 0
    for name, p in base.named_parameters():
        n = p.numel()
        # the routed experts' fused stacks (ERNIE-4.5-VL: `mlp.text_moe.experts.*` and `mlp.vision_moe.experts.*` too)
        if name.replace(".base_layer", "").endswith((".experts.gate_up_proj", ".experts.down_proj")) and not p.requires_grad:
            experts_frozen, stacks, per_stack = experts_frozen + n, stacks + 1, p.shape[0]
        if p.requires_grad:
            trainable += n
        elif id(p) in linear_ids:
            linear += n
        elif ".mlp.gate." in name or "_moe.gate." in name:  # the routers and their statistics: fp32 (_keep_in_fp32_modules_strict)
            fp32 += n
        else:
            other += n

    trained, lora, ranks, expert_lora, expert_split = set(), set(), {}, False, False
    layer_weights: dict[int, int] = {}
    for name, module in base.named_modules():
        layer, kind = _layer_kind(name)
        if layer is None or not kind:
            continue
        if type(module).__name__ in ("ParamWrapper", "SplitExperts"):
            expert_lora = True
            expert_split = expert_split or type(module).__name__ == "SplitExperts"
            ranks[f"experts.{module.parameter_name}"] = next(iter(module.r.values()))
            trained.add("experts")
            lora.add("experts")
            continue
        if hasattr(module, "lora_A") and len(module.lora_A):
            trained.add(kind)
            lora.add(kind)
            ranks[kind] = next(iter(module.lora_A.values())).out_features
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and not hasattr(module, "base_layer"):
            if isinstance(module, torch.nn.Linear):
                layer_weights[layer] = layer_weights.get(layer, 0) + weight.numel()
            if weight.requires_grad and not _is_lora_factor(name):
                trained.add("norm" if kind.endswith("layernorm") else "router" if kind == "mlp.gate" else kind)
        if kind == "mlp.experts" and any(p.requires_grad for p in module.parameters(recurse=False)):
            trained.add("experts")
    experts_numel = moe_layers = 0
    for name, p in base.named_parameters():
        name = name.replace(".base_layer", "")  # peft's wrappers
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            experts_numel += p.numel()
            moe_layers += name.endswith("gate_up_proj")
    matmul = sum(m.weight.numel() for m in base.modules() if isinstance(m, torch.nn.Linear))
    per_layer: dict[int, int] = {}
    for name, p in base.named_parameters():
        index = name.split(".layers.", 1)[1].split(".", 1)[0] if ".layers." in name else ""
        if index.isdigit():
            per_layer[int(index)] = per_layer.get(int(index), 0) + p.numel()
    return Params(
        linear_modules=len(linear_ids),
        experts_frozen=experts_frozen,
        expert_stacks=stacks,
        experts_per_stack=per_stack,
        linear=linear,
        fp32=fp32,
        other=other,
        trainable=trainable,
        trained=frozenset(trained),
        lora=frozenset(lora),
        lora_rank=ranks,
        lora_dropout=lora_dropout,
        expert_lora=expert_lora,
        expert_split=expert_split,
        expert_params_per_layer=experts_numel // max(1, moe_layers),
        head_trains=bool(head is not None and head.weight.requires_grad),
        matmul_weights=matmul,
        largest_linear=largest,
        layer_matmul_max=max(layer_weights.values(), default=0),
        layer_matmul_total=sum(layer_weights.values()),
        layer_params_max=max(per_layer.values(), default=0),
    )


def _is_lora_factor(name: str) -> bool:
    return ".lora_" in name


def _layer_kind(name: str) -> tuple[int | None, str]:
    """`...layers.3.self_attn.q_proj.base_layer` -> (3, "q_proj"); shared experts get a "shared." prefix."""
    if ".layers." not in name:
        return None, ""
    rest = name.split(".layers.", 1)[1]
    index, _, path = rest.partition(".")
    if not index.isdigit():
        return None, ""
    parts = [p for p in path.split(".") if p != "base_layer"]
    if any(p.startswith("lora_") for p in parts):
        return None, ""
    path = ".".join(parts)
    if path.startswith("self_attn."):
        kind = path.removeprefix("self_attn.")
    elif path.startswith("mlp.shared_experts."):
        kind = "shared." + path.removeprefix("mlp.shared_experts.")
    elif path in ("mlp.gate", "mlp.experts"):
        kind = path
    elif path.startswith("mlp.") and path.count(".") == 1:
        kind = path.removeprefix("mlp.")
    elif path in ("input_layernorm", "post_attention_layernorm"):
        kind = path
    else:
        kind = ""
    return int(index), kind


# ---------------------------------------------------------------------------------------------------------------
# The estimate


def kv_repeats(heads: int, kv_heads: int, n: int) -> int | None:
    """How often each key/value head is repeated so that N processes sharing a row (distributed.sequence_parallel)
    each hold whole query groups: 1 when N divides the key/value heads; None when N does not divide the query heads
    (N cannot split this model)."""
    if heads % n:
        return None
    repeats = n // math.gcd(kv_heads, n)
    return repeats if heads % (kv_heads * repeats) == 0 else None


def splits_of(heads: int, kv_heads: int, limit: int = 16) -> list[int]:
    """The N > 1 (up to `limit`) a model with these heads takes (`validate` prints them)."""
    return [n for n in range(2, limit + 1) if kv_repeats(heads, kv_heads, n) is not None]


def all_to_all_bytes(shape: Shape, run: Run) -> int:
    """Per layer and token of this process's share, what Ulysses attention keeps beyond a process with the whole
    row (model/sequence_parallel.py): attention's output before the inverse all-to-all, a tensor apart from o_proj's
    input (one tensor otherwise), and the key/value heads repeated where N does not divide them."""
    n = run.sequence_parallel
    if n == 1:
        return 0
    b = 2 if run.autocast else run.dtype_bytes
    repeats = kv_repeats(shape.heads, shape.kv_heads, n) or 1  # a split the model cannot take is refused by the plan
    return b * shape.head_dim * (shape.heads + 2 * (repeats - 1) * shape.kv_heads)


def estimate(shape: Shape, params: Params, run: Run) -> Estimate:
    r = run.dtype_bytes
    lora_bytes = 2 if run.load_in_4bit else 4
    full = not params.lora
    train_bytes = r if full else lora_bytes
    notes: list[str] = []

    linear_bytes = NF4_BYTES if run.load_in_4bit else r
    weights = int(params.linear * linear_bytes + params.fp32 * 4 + params.other * r + params.trainable * train_bytes)
    if run.load_in_4bit:
        weights += params.linear_modules * NF4_MODULE_BYTES
        # the routed experts too (model/expert_4bit.py): NF4 as a Linear4bit, with one absmax offset per expert
        weights += int(params.experts_frozen * (NF4_BYTES - r))
        weights += params.expert_stacks * (NF4_MODULE_BYTES - 4 + 4 * params.experts_per_stack)
    gradients = params.trainable * train_bytes
    states, state_bytes = _optimizer(run.optim, train_bytes)
    if states is None:
        notes.append(f"optimizer {run.optim}: assumed 2 states per trainable parameter, as AdamW")
        states, state_bytes = 2, train_bytes
    optimizer = params.trainable * states * state_bytes
    if run.ema:  # kept beside the optimizer states for the whole run
        optimizer += params.trainable * 4
        notes.append("train.ema: an fp32 copy of the trained parameters, counted with the optimizer states")

    layer = _layer_bytes(shape, params, run)  # layer index -> saved bytes per token
    ckpt = {i for i in range(shape.layers) if run.checkpointing and i % max(1, run.every_n_layers) == 0}
    t = run.tokens
    kept = sum(layer[i] for i in range(shape.layers) if i not in ckpt)
    if ckpt:
        kept += 0 if run.offload else len(ckpt) * r * shape.hidden
        kept += 8 * shape.head_dim  # the rope cos/sin every checkpointed layer recomputes from
    kept += _final_norm(shape, params, run)
    exchange = all_to_all_bytes(shape, run)
    kept += exchange * (shape.layers - len(ckpt))
    activations = kept * t
    recompute = (max((layer[i] for i in ckpt), default=0) + (exchange if ckpt else 0)) * t  # the layer recomputed in backward
    if exchange:
        notes.append(f"distributed.sequence_parallel {run.sequence_parallel}: activations and LM-head positions are this "
                     f"process's 1/{run.sequence_parallel} of each row; the all-to-all copies attention keeps add "
                     f"{size(exchange * t * max(1, shape.layers - len(ckpt)))}")
    merged = params.expert_params_per_layer * r if params.expert_lora and not params.expert_split else 0
    # peft merges W + B@A per MoE layer in every forward; autograd keeps the merged stack for backward
    if merged:
        activations += merged * sum(1 for i in shape.moe_layers if i not in ckpt)
        if any(i in ckpt for i in shape.moe_layers):
            recompute += merged
    if params.expert_split:  # each expert adapter's B laid out, kept from one optimizer step to the next, every layer's
        activations += _split_copies(shape, params, run) * len(shape.moe_layers)
    weight_copies = run.autocast and r == 4 and not run.load_in_4bit
    if weight_copies:
        # autocast's bf16 copy of every linear weight is kept for backward (of the layers not checkpointed)
        activations += 2 * params.layer_matmul_total * (shape.layers - len(ckpt)) // shape.layers
        recompute += 2 * params.layer_matmul_max if ckpt else 0

    vocab = shape.vocab
    step = max(1, run.chunk_elements // vocab)
    scored = max(1, min(run.scored, run.tokens))
    chunk = min(scored, step)
    b = 2 if (run.autocast or r == 2) else 4
    layer_phase = recompute + max(layer.values()) * t // 4 + merged
    if run.load_in_4bit:
        # The largest 4-bit weight dequantized to bf16 as it runs: a linear, x2 for forward's and backward's copies (a
        # bound, since bitsandbytes' MatMul4Bit frees forward's copy as the matmul returns: measured on CPU, one copy
        # alive, benchmarks/memory_check.py's held-out QLoRA case), or the routed experts' largest run
        # (`_expert_run_bytes`). The layer phase only: the tied LM head is not quantized
        layer_phase += max(2 * params.largest_linear * 2, _expert_run_bytes(shape, t) if params.experts_frozen else 0)
    if full:
        layer_phase += 2 * params.layer_params_max * train_bytes
    if params.head_trains:
        # Each chunk keeps its fp32 exp(logits - max) for backward: all of them (no recompute, `head_keep`, or a
        # single chunk), or none, when every chunk is checkpointed and recomputed in backward
        multi = scored > step and not run.head_keep
        if multi:  # the scored hidden states stay, the chunk is recomputed in backward
            head_input = scored * shape.hidden * r
        else:  # the head's input, for its gradient (autocast keeps its bf16 copy)
            head_input = scored * shape.hidden * (2 if run.autocast and r == 4 else r)
        kept = 0 if multi else 4 * scored * vocab
        logits = kept + 8 * scored + head_input
        if weight_copies:
            logits += 2 * vocab * shape.hidden  # autocast's bf16 copy of the LM head
        # Backward, the larger phase: the kept softmax buffer, which backward turns into the gradient in place
        # (scoring._TokenLogProb), plus the head's weight gradient; when recomputed, the recomputed buffer too, or with
        # several chunks the head-weight gradient of a chunk, the running sum and the new sum (3 x vocab x hidden);
        # or one layer: (with checkpointing) its recomputed activations, plus the activation gradients in flight
        # (measured: a quarter of the layer's saved activations), plus with full fine-tuning its weight gradients
        # before they are added to .grad, and with expert LoRA the merged expert stack's gradient. By the layer
        # phase every kept exp buffer has become its gradient and been freed.
        # (the softmax is computed in place: a kept chunk needs nothing beside its buffer but the head's weight gradient)
        lm_phase = 8 * chunk * vocab if multi else vocab * shape.hidden * train_bytes
        if scored > step:
            lm_phase = max(lm_phase, 3 * vocab * shape.hidden * train_bytes)
        transient = max(lm_phase, layer_phase - kept)
    else:
        # A frozen head (LoRA, QLoRA): each chunk's gradient w.r.t. its hidden states is computed in forward and
        # kept (P x h in r); no logits outlive their chunk. The chunk's working set, at the end of the forward:
        # the head's output, its fp32 exp (the same buffer in fp32), the gradient cast back to b, and for the
        # preference methods' metrics (DPO, ORPO, SimPO) a second fp32 buffer (scoring._head_chunks)
        logits = 8 * scored + scored * shape.hidden * r
        lm_phase = (4 + (2 * b if b != 4 else 0) + (4 if run.method in ("dpo", "orpo", "simpo", "kto") else 0)) * chunk * vocab
        if weight_copies:
            lm_phase += 2 * vocab * shape.hidden  # autocast casts a frozen weight for every call (it caches trained ones only)
        transient = max(lm_phase, layer_phase)

    reference = reference_copy = 0
    if run.method in ("dpo", "kto", "grpo") and run.reference in ("adapter", "copy"):
        # the no-grad reference forward runs while the policy's activations are alive: one layer's
        # working set and one logits chunk (the head's output, its fp32 copy, the metrics' exp buffer) at a time
        ref_working = max(max(layer.values()) * t, (8 + (b if b != 4 else 0)) * chunk * vocab
                          + (2 * vocab * shape.hidden if weight_copies else 0))  # (not yet measured)
        reference = max(0, ref_working - transient)
        if run.reference == "copy":
            reference_copy = int(params.linear * r + params.fp32 * 4 + params.other * r + params.trainable * r)
            reference += reference_copy

    generation = generation_bytes(shape, run, b)
    training = activations + logits + transient + reference - reference_copy
    host = 0
    if run.host_offload == "optimizer":
        # train/offload.py's HostStep: per trainable parameter an fp32 master, an fp32 gradient staging buffer and the
        # optimizer's fp32 states on the host; the device keeps the weights, their gradients and the EMA
        host = params.trainable * (8 + 4 * states)
        optimizer -= params.trainable * states * state_bytes
    elif run.host_offload == "parameters":
        # FSDP2's CPUOffloadPolicy: every sharded weight, gradient and state on the host (accelerate makes trainable
        # parameters fp32 under FSDP2 mixed precision), 1/N each per process; the device holds the units in flight:
        # three decoder layers (the one running, the next prefetched, a gradient unsharded) and the root unit
        # (embedding and tied head) in the compute dtype
        t = 4 if run.autocast else train_bytes
        frozen = weights - params.trainable * train_bytes
        host = (params.trainable * t * (2 + states) + frozen + (4 * params.trainable if run.ema else 0)) // max(1, run.processes)
        weights = 3 * params.layer_params_max * b + vocab * shape.hidden * b
        gradients = optimizer = 0
    sync, sync_peak = sync_bytes(params, run, train_bytes)
    allocated = weights + gradients + optimizer + reference_copy + sync + max(training, generation, sync_peak)
    overhead = CONTEXT_BYTES + int(FRAGMENTATION * allocated)
    four_bit = ""
    if run.load_in_4bit:
        linears = "attention, dense-layer MLP and shared-expert" if shape.experts else "attention and MLP"
        experts = f" + {params.experts_frozen:,} (fused routed experts)" if params.experts_frozen else ""
        four_bit = (
            f"4-bit NF4: {params.linear:,} parameters ({linears} nn.Linear weights){experts}; "
            f"{_dtype_name(r)}: {params.other - params.experts_frozen:,} (embeddings/LM head, norms)"
            + (f"; fp32: {params.fp32:,} (router)" if params.fp32 else "")
        )
    return Estimate(weights, gradients, optimizer, activations, logits, transient, reference, overhead, notes, four_bit, reference_copy,
                    generation, host, sync, sync_peak)


def sync_bytes(params: Params, run: Run, grad_bytes: int) -> tuple[int, int]:
    """(kept, peak) of `distributed.sync` (train/sync.py), read at torch 2.13. PowerSGD over the one gradient bucket
    (trainer_args) keeps an error-feedback buffer the size of every gradient (`error_dict`) and clones the bucket each
    step (`input_tensor_cp`), from the third step; local SGD flattens the trained parameters of each dtype into one
    buffer at each averaging (`sync.average`), and under train.ema the fp32 EMA at each save. Neither is alive with
    the forward's activations: the clone comes as backward ends, the averaging after the optimizer step."""
    grads = params.trainable * grad_bytes
    if run.sync == "powersgd":
        return grads, grads
    if run.sync == "local_sgd":
        return 0, max(grads, 4 * params.trainable if run.ema else 0)
    return 0, 0


def generation_bytes(shape: Shape, run: Run, b: int) -> int:
    """GRPO's generation phase (transformers' `generate`, no grad): the KV cache of every sequence at its longest,
    2 x L x K x d values per token in the matmul dtype, plus the last position's logits per sequence (the head's
    output, its fp32 copy and the sampling probabilities). Training's activations are freed by then. Not measured."""
    n, length = run.generate_sequences, run.generate_length
    if not n:
        return 0
    kv = n * length * shape.layers * 2 * shape.kv_heads * shape.head_dim * b
    return kv + n * shape.vocab * (b + 8)


def sharded_total(est: Estimate, params: Params, run: Run, devices: int) -> int:
    """Rough per-device peak when FSDP / DeepSpeed ZeRO-3 shard weights, gradients and optimizer states over
    `devices`: the sharded states, plus one decoder layer gathered in full (with the next one prefetched and its
    unsharded gradient: 3 layers' worth), plus everything per-token as before. Not measured."""
    states = est.static
    gathered = 3 * params.layer_params_max * run.dtype_bytes
    allocated = states // devices + gathered + max(est.training, est.generation)
    return allocated + CONTEXT_BYTES + int(FRAGMENTATION * allocated)


def _dtype_name(n: int) -> str:
    return {2: "bf16", 4: "fp32"}.get(n, f"{n}-byte")


def _optimizer(optim: str, param_bytes: int) -> tuple[int | None, int]:
    name = str(getattr(optim, "value", optim)).lower()
    if "8bit" in name:
        return 2, 1
    if name.startswith("sgd"):
        return 0, 0
    if name.startswith("adafactor"):
        return 0, 0
    if name.startswith(("lion", "rmsprop", "adagrad")):
        return 1, param_bytes
    if name.startswith(ADAM_LIKE):
        return 2, param_bytes
    return None, param_bytes


def _layer_bytes(shape: Shape, params: Params, run: Run) -> dict[int, int]:
    """Bytes autograd keeps per token for each decoder layer (no checkpointing)."""
    out = {}
    for i in range(shape.layers):
        # Under LoRA without checkpointing the embedding output needs no gradient, so layer 0's first norm keeps nothing
        grad_in = i > 0 or not params.lora or run.checkpointing
        out[i] = _one_layer(shape, params, run, moe=i in shape.moe_layers, grad_in=grad_in)
    return out


def _one_layer(shape: Shape, params: Params, run: Run, moe: bool, grad_in: bool) -> int:
    h, d, heads, kv = shape.hidden, shape.head_dim, shape.heads, shape.kv_heads
    r = run.dtype_bytes
    b = 2 if (run.autocast or r == 2) else 4
    p = 2 if run.load_in_4bit else 4
    trained = params.trained
    saved: dict[str, int] = {}  # dedupes tensors several ops keep (one storage)

    def norm(key: str, first: bool = False) -> None:
        if first and not grad_in:
            return
        saved[key + ".x"] = 4 * h + 4  # fp32 input (or its fp32 copy) and 1/rms
        if "norm" in trained:
            saved[key + ".hs"] = r * h  # the normalised input, for the norm weight's gradient

    def inputs(source: str, size: int, dtype: int, consumers: list[str], grad: bool = True) -> None:
        """The input of each consumer that trains: one shared tensor, or a fresh copy per consumer when cast."""
        for c in consumers:
            if c not in trained:
                continue
            if c in params.lora:
                kept, fresh = dtype, False
                if kept != p:
                    kept, fresh = p, True  # peft casts the input to the adapter's dtype
                if params.lora_dropout > 0:
                    fresh = True
                    if grad:  # the dropout mask (bool on CUDA; CPU keeps it in the input's dtype)
                        saved[f"{c}.mask"] = size * (1 if run.device == "cuda" else kept)
                if run.autocast and kept != 2:
                    kept, fresh = 2, True  # autocast casts it for lora_A
                rank = params.lora_rank.get(c, 8)
                saved[f"{c}.lora_mid"] = rank * (2 if run.autocast else p)
            else:
                kept, fresh = dtype, False
                if run.autocast and dtype != 2:
                    kept, fresh = 2, True  # autocast casts the input for each linear separately
            saved[f"{source}>{c}" if fresh else source] = size * kept

    # attention
    norm("n1", first=True)
    inputs("n1", h, r, ["q_proj", "k_proj", "v_proj"], grad=grad_in)
    saved["rope"] = 8 * d
    saved["qkv"] = b * (heads + 2 * kv) * d
    saved["out"] = b * heads * d
    saved["lse"] = 4 * heads
    if run.attention == "eager":
        saved["probs"] = (4 + b) * heads * max(1, run.row_length)
    inputs("out" if run.attention == "flash" else "attn_out", heads * d, b, ["o_proj"])
    norm("n2")
    # MLP
    if moe:
        mi, k = shape.moe_intermediate, shape.top_k
        shared = shape.shared_experts * mi
        if shared:
            inputs("n2", h, r, ["shared.gate_proj", "shared.up_proj"])
            saved["shared.act"] = 3 * b * shared
            inputs("shared.prod", shared, b, ["shared.down_proj"])
        saved["router"] = 4 * shape.experts + 28 * k
        if "router" in trained:
            saved["n2" if r == 4 else "n2>router"] = 4 * h
        # routed experts (grouped_mm runs in the expert weights' dtype): gate_up output, silu output, down output
        saved["experts.act"] = k * r * (2 * mi + mi + h)
        if "experts" in trained:
            saved["experts.inputs"] = k * r * (h + mi)  # gathered tokens, down_proj input
        if params.expert_split:  # each adapter's rank-r intermediate, in the experts' dtype
            ranks = (params.lora_rank.get(f"experts.{n}", 0) for n in ("gate_up_proj", "down_proj"))
            saved["experts.lora_mid"] = k * r * sum(ranks)
    else:
        inputs("n2", h, r, ["gate_proj", "up_proj"])
        saved["mlp.act"] = 3 * b * shape.intermediate
        inputs("prod", shape.intermediate, b, ["down_proj"])
    return sum(saved.values())


def _split_copies(shape: Shape, params: Params, run: Run) -> int:
    """Bytes split expert LoRA keeps per MoE layer beside the activations: each adapter's B as a dense copy in the
    experts' dtype, and A cast to it when the adapters' dtype differs."""
    r, h, mi = run.dtype_bytes, shape.hidden, shape.moe_intermediate
    gate_up, down = (params.lora_rank.get(f"experts.{n}", 0) for n in ("gate_up_proj", "down_proj"))
    cast = r != (2 if run.load_in_4bit else 4)
    return shape.experts * r * (gate_up * (2 * mi + h * cast) + down * (h + mi * cast))


def _expert_run_bytes(shape: Shape, tokens: int) -> int:
    """What 4-bit routed experts hold at once (model/expert_4bit.py): one run of rows dequantized (2 B each), its
    packed bytes gathered (0.5 B) and its absmax as floats (4 B per 64); with several runs, backward's fp32 sum of the
    runs' input gradients and one run's part (6 B per routed token and input feature)."""
    from erniekit_lite.model.expert_4bit import run_rows

    e, h, m = shape.experts, shape.hidden, shape.moe_intermediate
    largest = 0
    for out, inner in ((2 * m, h), (h, m)):
        rows = run_rows((e, out, inner), 2)
        largest = max(largest, int(e * rows * inner * (2 + 0.5 + 4 / 64)) + (6 * tokens * shape.top_k * inner if rows < out else 0))
    return largest


def _final_norm(shape: Shape, params: Params, run: Run) -> int:
    return 4 * shape.hidden + 4 + (run.dtype_bytes * shape.hidden if "norm" in params.trained else 0)


# ---------------------------------------------------------------------------------------------------------------
# From a recipe


def sync_memory(est: Estimate, run: Run) -> str:
    """What distributed.sync adds to the plan (sync_bytes), for validate's sync line; "" when nothing."""
    if run.sync == "powersgd":
        return (f"memory: {size(est.sync)} of error feedback kept (every gradient's size) and the gradient bucket cloned "
                f"each step, {size(est.sync_peak)}, counted in the plan below")
    if run.sync == "local_sgd":
        return (f"memory: the trained parameters flattened at each averaging{' (and the EMA at each save)' if run.ema else ''}, "
                f"{size(est.sync_peak)}, counted in the plan below")
    return ""


def format_lines(est: Estimate, run: Run, gpu: int | None) -> list[str]:
    """What validate prints: the total, the device it is for (`validate` plans the CUDA run on any machine) and the
    GPU it fits, then the components (GiB)."""
    g = lambda n: f"{n / GIB:.1f}"  # noqa: E731
    precision = ("bf16 autocast" if run.autocast else _dtype_name(run.dtype_bytes)) + (", 4-bit base" if run.load_in_4bit else "")
    ckpt = "activation checkpointing " + ("on" if run.checkpointing else "off")
    if run.checkpointing and run.every_n_layers > 1:
        ckpt += f" every {run.every_n_layers} layers"
    if run.checkpointing and run.offload:
        ckpt += ", inputs offloaded"
    fits = f"fits {a_gpu(gpu)}" if gpu else f"does not fit one {GPUS_GB[-1]} GB GPU"
    parts = [
        f"{'weights in flight' if run.host_offload == 'parameters' else 'weights'} {g(est.weights)}",
        f"gradients {g(est.gradients)}",
        f"optimizer {g(est.optimizer)}",
        f"activations {g(est.activations + est.logits)}",
        f"backward working set {g(est.transient)}",
    ]
    if est.reference:
        parts.append(f"reference {g(est.reference)}")
    parts.append(f"overhead {g(est.overhead)}")
    if est.generation:  # GRPO: generation's memory takes the place of training's activations and working set
        parts = parts[:3] + [f"max(training {g(est.training)}, generation {g(est.generation)})", parts[-1]]
    lines = [
        f"memory per device (estimate): {g(est.total)} GiB for {run.tokens:,} tokens per micro-batch "
        f"on {'a CUDA GPU' if run.device == 'cuda' else run.device} ({precision}, {ckpt}); {fits}",
        f"  = {' + '.join(parts)} GiB",
    ]
    if run.host_offload != "none":
        lines.append(f"  host memory (train.offload: {run.host_offload}): {g(est.host)} GiB per process, {HOST_HELD[run.host_offload]}")
    if est.four_bit:
        lines.append(f"  {est.four_bit}")
    if est.generation:
        lines.append(f"  generation: KV cache and sampling logits of {run.generate_sequences} sequences x {run.generate_length:,} "
                     f"tokens (prompt + completion) at once, {g(est.generation)} GiB; training = activations "
                     f"{g(est.activations + est.logits)} + working set {g(est.transient)}"
                     + (f" + reference {g(est.reference - est.reference_copy)}" if est.reference - est.reference_copy else ""))
    return lines
