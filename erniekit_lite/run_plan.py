"""The run's plan: everything `train` decides before its first step, resolved once, before the model loads.

`resolve` reads the recipe, the Trainer arguments built from it and the memory free on this machine, and returns one
frozen `RunPlan`: where the weights and tokenizer come from, the architecture, attention, activation checkpointing,
whether a trained LM head keeps its chunks, train.offload, distributed.sync, compiled layers, the adapters, the router
losses, EMA. `train` (train/run.py) executes it; `validate` prints it for this machine beside its GPU plan. Nothing
later re-decides, with one exception that says so when it happens: a first step that runs out of memory with activation
checkpointing off, where this plan turned it off, turns it back on (train/step.py).

The decisions themselves and their memory estimates are plan.py's (`choose_checkpointing`, `choose_offload`,
`head_keep_positions`); this module puts them in order and keeps what they decided.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from erniekit_lite import memory
from erniekit_lite.errors import UserError
from erniekit_lite.recipe import DataSection, DistributedSection, LoraSection, Recipe, RewardEntry, own_train


@dataclass(frozen=True)
class Applied:
    mode: str  # none | optimizer | parameters
    host_bytes: int  # what the plan says the offloaded state takes on the host, per process


VL_METHODS = ("sft", "dpo")  # the methods an ERNIE-4.5-VL model trains with


SLOW_BF16 = ("this CPU has no bf16 instructions (AVX512-BF16 or AMX): bf16 autocast trains several times slower than "
             "fp32 here (4-12x measured: docs/performance.md, bf16 on a CPU); train.bf16=false trains in fp32")


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 itself, as /proc/cpuinfo's flags say (x86: avx512_bf16 or amx_bf16; Arm: the
    bf16 feature). True where the flags cannot be read: no note rather than a wrong one."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True
    flags = [set(line.split(":", 1)[1].split()) for line in cpuinfo.splitlines()
             if line.split(":", 1)[0].strip() in ("flags", "Features") and ":" in line]
    return not flags or bool(flags[0] & {"avx512_bf16", "amx_bf16", "bf16"})


@dataclass(frozen=True)
class RunPlan:
    method: str
    out: Path
    source: str  # model.path: a Hub id, a model folder, or a LoRA run's output folder
    base: str | None  # that run's base model, when model.path is an adapter
    tokenizer: str  # where the tokenizer is read (an adapter folder without one: its base)
    architecture: str  # the model's class as its config.json names it
    moe: bool
    vl: bool  # ERNIE-4.5-VL: image-text data, images encoded by the model (model/vl.py)
    vision_trains: bool  # ERNIE-4.5-VL: the vision encoder and resampler train (model.train_vision, lora.vision)
    dtype: str
    load_in_4bit: bool
    trust_remote_code: bool
    attention: str  # model.attn_implementation, `auto` resolved for this machine
    seed: int  # train.seed: new adapters start from it
    lora: LoraSection | None
    lora_forward: str  # fused | peft (and why): how the adapted Linear layers run (model/fused_lora.py)
    checkpointing: bool  # activation checkpointing, as the run applies it
    checkpointing_by_plan: bool  # turned off here because the plan fits: the first step's one allowed re-decision
    head_trains: bool  # full fine-tuning of a causal LM: the LM head (tied to the embeddings) trains
    head_keep_positions: int  # a trained head keeps its chunks for backward up to this many positions (0: recompute)
    offload: Applied
    sync: DistributedSection
    sequence_parallel: int  # distributed.sequence_parallel: processes sharing each row's tokens (1: none)
    compile_layers: bool
    compile_backend: str | None
    router: dict  # the MoE router's z-loss and orthogonal-loss coefficients the method takes ({} for none)
    ema: dict | None  # train.ema: decay and start step
    expert_load: bool  # MoE: expert load recorded (output.expert_load)
    slow_bf16: bool  # bf16 autocast on a CPU without bf16 instructions (cpu_has_bf16): said, many times slower than fp32
    # what the method's trainer reads of the recipe as written
    data: DataSection  # rows (max_length, packing), the reference cache, the system prompt
    rewards: tuple[RewardEntry, ...]  # GRPO's rewards
    sample_prompts: tuple[str, ...]  # answered after training (output.sample_prompts)

    def lines(self, where: str = "") -> list[str]:
        """The plan as `train` prints it, and `validate` (`where`: " on this machine")."""
        source = self.source + (f" (an adapter on {self.base})" if self.base else "")
        adapters = (f"LoRA r={self.lora.r}" + (f", routed experts {self.lora.expert_compute}" if self.moe and not self.vl and
                    self.lora.routed_experts else "")) if self.lora is not None else "full fine-tuning"
        head = ("trains, chunks " + (f"kept for backward (up to {self.head_keep_positions:,} positions)"
                                     if self.head_keep_positions else "recomputed in backward")) if self.head_trains else "frozen"
        checkpointing = "on" if self.checkpointing else "off" + (" (the plan fits without it; back on if the first step runs "
                                                                  "out of memory)" if self.checkpointing_by_plan else "")
        offload = self.offload.mode + (f" ({memory.size(self.offload.host_bytes)} per process on the host)"
                                       if self.offload.mode != "none" else "")
        return [
            f"run plan{where} ({self.method}): {self.architecture} from {source}, tokenizer {self.tokenizer}; {self.dtype} weights"
            + (" (4-bit NF4 base)" if self.load_in_4bit else "") + f", attention {self.attention}, {adapters}"
            + (f" (forward {self.lora_forward})" if self.lora is not None else ""),
            f"  activation checkpointing {checkpointing}; LM head {head}; train.offload {offload}; "
            f"compile {'on (' + (self.compile_backend or 'inductor') + ')' if self.compile_layers else 'off'}; "
            f"sync {self.sync.sync}" + (f"; sequence parallel {self.sequence_parallel} (each process holds 1/"
                                         f"{self.sequence_parallel} of a row's tokens)" if self.sequence_parallel > 1 else "")
            + (f"; ema decay {self.ema['decay']:g} from step {self.ema['start']}" if self.ema else "")
            + ("; router " + ", ".join(f"{k.removeprefix('router_').removesuffix('_coef')} {v:g}" for k, v in self.router.items())
               if self.router else ""),
        ] + ([f"  note: {SLOW_BF16}"] if self.slow_bf16 else [])


@dataclass(frozen=True)
class Launch:
    """How the run's processes are set up: `how` fsdp, deepspeed or plain (one process or DDP), `processes` in all,
    `zero3`: DeepSpeed shards the parameters. In a worker from the variables `accelerate launch` set (`strategy`);
    before launching, from the command line and the accelerate config (`launch.launch_of`)."""

    how: str = "plain"
    processes: int = 1
    zero3: bool = False


def refuse_unlaunchable(recipe: Recipe, launch: Launch) -> None:
    """What the recipe asks that this launch cannot run, in one line: said by `validate` and by `train` before any
    process starts (launch.py), and by each worker of a process started another way."""
    sharded = {"fsdp": "FSDP", "deepspeed": "DEEPSPEED"}.get(launch.how)
    sync = recipe.distributed.sync
    if sync != "every_step" and sharded:
        raise UserError(f"distributed.sync: {sync} changes how DDP synchronises, and this run shards with {sharded}; use "
                        "sync: every_step, or DDP (no --accelerate-config sharding)")
    if recipe.train.get("ema") and (launch.how == "fsdp" or launch.zero3):
        raise UserError("train.ema: the parameters are sharded across processes (FSDP, ZeRO-3), and the EMA would gather "
                        "them every step; use DDP or ZeRO-1/2, or remove train.ema")
    split = recipe.distributed.sequence_parallel
    if split > 1 and launch.how == "deepspeed":
        raise UserError("distributed.sequence_parallel: runs under DDP or FSDP2 (--accelerate-config "
                        "recipes/accelerate/fsdp2.yaml), not DeepSpeed")
    if split > 1 and launch.processes > 1 and launch.processes % split:
        raise UserError(f"distributed.sequence_parallel: {split} must divide the launch's {launch.processes} processes "
                        f"(data-parallel groups x {split}); use --num-processes {split * max(1, launch.processes // split)}")
    mode = own_train(recipe, "offload")
    if mode != "none" and launch.how == "deepspeed":
        raise UserError(f"train.offload: {mode}: DeepSpeed offloads through its own config (offload_optimizer_device, "
                        "offload_param_device); set it there and leave train.offload at none")
    if mode == "optimizer" and launch.how == "fsdp":
        raise UserError("train.offload: optimizer: FSDP keeps the optimizer state with its shards; use train.offload: "
                        "parameters (FSDP2's CPU offload), or run without --accelerate-config")
    if mode == "parameters" and launch.how != "fsdp":
        raise UserError("train.offload: parameters runs under FSDP2, which `erniekit-lite train` launches itself; this "
                        "process was started another way: use `accelerate launch --use_fsdp --fsdp_version 2 "
                        "--fsdp_offload_params true ...` or `erniekit-lite train`")


SEQUENCE_METHODS = ("sft", "pt", "dpo", "orpo", "simpo", "kto", "rm")  # the packing methods whose scores come back whole


def early_checks(recipe: Recipe) -> None:
    """What can be refused from a local model folder's config.json alone, before anything heavy loads (the run's own
    checks say the same later): a sequence_parallel N the model's heads do not take."""
    import json

    n = recipe.distributed.sequence_parallel
    config = Path(recipe.model.path).expanduser() / "config.json"
    if n == 1 or not config.is_file():
        return
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
        text = raw.get("text_config") or raw
        heads = int(text["num_attention_heads"])
        kv = int(text.get("num_key_value_heads") or heads)
    except (ValueError, KeyError, TypeError, AttributeError):
        return  # the model's loader says what is wrong with it
    refuse_split(n, heads, kv)


def refuse_split(n: int, heads: int, kv: int) -> None:
    """The one refusal of a sequence_parallel N the model's heads do not take (early_checks, check_sequence_parallel)."""
    if memory.kv_repeats(heads, kv, n) is None:
        raise UserError(f"distributed.sequence_parallel: {n} does not divide this model's {heads} attention heads; it "
                        f"takes {', '.join(map(str, memory.splits_of(heads, kv))) or 'none'}")


def check_sequence_parallel(recipe: Recipe, config, vl: bool, args) -> None:
    """What `distributed.sequence_parallel` > 1 needs of the recipe and the model, each refusal one line."""
    from erniekit_lite.model.attention import PACKED

    n, key = recipe.distributed.sequence_parallel, "distributed.sequence_parallel"
    if recipe.method not in SEQUENCE_METHODS:
        raise UserError(f"{key}: method {recipe.method}: not available (its generation batches are not split); it "
                        f"takes {', '.join(SEQUENCE_METHODS)}")
    if vl:
        raise UserError(f"{key}: not for ERNIE-4.5-VL runs yet (images are encoded whole on each process)")
    if not recipe.data.packing:
        raise UserError(f"{key}: splits packed rows; set data.packing: true")
    attention = recipe.model.attn_implementation
    if attention not in ("auto", *PACKED):
        raise UserError(f"{key}: attention runs per sample between two all-to-alls ({' or '.join(PACKED)}); "
                        f"model.attn_implementation {attention} cannot: use auto")
    if recipe.distributed.sync == "local_sgd":
        raise UserError(f"{key}: the processes of a row must sum their gradients every step; distributed.sync: "
                        "local_sgd does not")
    if getattr(args, "precompute_ref_log_probs", False):
        raise UserError(f"{key}: train.precompute_ref_log_probs: not with split rows yet (the reference is scored in "
                        "each step)")
    if recipe.model.compile_layers:
        raise UserError(f"{key}: model.compile_layers: not with split rows yet (the all-to-alls run inside each "
                        "layer's attention); remove one of them")
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    refuse_split(n, heads, kv)


def lora_forward(recipe: Recipe, zero3: bool) -> str:
    """How the run's adapted Linear layers compute: `fused` (one autograd step each, model/fused_lora.py) unless the
    recipe asks what the fused step leaves out; an adapter folder trained on here is checked layer by layer too
    (a bias of its own, a trained base bias), where a layer that differs keeps peft's forward and the log says so."""
    lora = recipe.lora
    if lora is None:
        return "none"
    why = ("a 4-bit base (QLoRA)" if recipe.model.load_in_4bit else "DoRA" if lora.use_dora else
           "dropout" if lora.dropout else "ZeRO-3 sharding" if zero3 else None)
    return f"peft's ({why})" if why else "fused"


def zero_stage_3(stage, config_file: str | None) -> bool:
    """Whether DeepSpeed shards the parameters (ZeRO-3): the accelerate config's `zero_stage`, or, when it names a
    DeepSpeed JSON (`deepspeed_config_file`), that file's `zero_optimization.stage`."""
    if str(stage) == "3":
        return True
    if not config_file:
        return False
    import json

    try:
        return str((json.loads(Path(config_file).read_text()).get("zero_optimization") or {}).get("stage")) == "3"
    except (OSError, ValueError, AttributeError) as error:
        raise UserError(f"{config_file}: not a readable DeepSpeed JSON config ({error})") from None


def worker_launch(processes: int) -> Launch:
    """This process's launch, from the variables `accelerate launch` set (`strategy`)."""
    how = strategy()
    return Launch(how, processes, how == "deepspeed" and zero_stage_3(
        os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE"), os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")))


def strategy() -> str:
    """How the launcher set this process up: fsdp, deepspeed, or plain (one process or DDP); read from the variables
    `accelerate launch` sets, since the arguments are built before accelerate's state."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
        return "deepspeed"
    return "fsdp" if os.environ.get("ACCELERATE_USE_FSDP") == "true" else "plain"


def resolve(recipe: Recipe, args, free_bytes: int, log=print, cuda: bool | None = None, launch: str | None = None,
            arch: dict | None = None, host_check: bool = True, source=None) -> RunPlan:
    """The plan of the run `recipe` makes with the Trainer arguments `args` on this machine, `free_bytes` free on the
    device it trains on (a GPU's free memory; on CPU the host's available memory). Each decision is logged as made.
    `args` takes the checkpointing decision (the Trainer and TRL read it there). `launch`: how this process was
    started (`strategy()`); `validate` says how `train` would launch it, hands in the `source` it located
    (model/source.py) and the `arch` it read, and turns `host_check` off (it says whether the host fits, and never
    refuses for it)."""
    import torch

    from erniekit_lite.model.attention import resolve_attention
    from erniekit_lite.model.source import locate
    from erniekit_lite.model.vl import is_vl
    from erniekit_lite.trainer_args import router_losses

    cuda = torch.cuda.is_available() if cuda is None else cuda
    this = worker_launch(args.world_size)
    planning = launch is not None  # validate, planning how `train` would launch the run
    launch = launch or this.how
    # the one refusal of what a sharded launch cannot run (the set-ups after the trainer trust it)
    refuse_unlaunchable(recipe, Launch(launch, args.world_size, this.zero3))
    source = source or locate(recipe.model.path, recipe.model.trust_remote_code)  # the one look at the model's files
    config = source.config
    # The model built on the meta device (its layout, for the memory estimates) only when a choice needs it, once: not
    # in a run that decides nothing from memory (a ZeRO-3 worker would build it sharded)
    layout = (lambda: arch) if arch is not None else functools.cache(lambda: architecture(source.weights, recipe, config))
    moe = memory.Shape.from_config(config).experts > 0
    vl = is_vl(config)
    if recipe.model.train_vision and (not vl or recipe.lora is not None):
        raise UserError("model.train_vision: full fine-tuning of an ERNIE-4.5-VL model only" + (" (with lora:, lora.vision: true)" if vl else ""))
    if vl and recipe.method not in VL_METHODS:
        raise UserError(f"method: {recipe.method}: not available for ERNIE-4.5-VL here; VL runs take {', '.join(VL_METHODS)}")
    if vl and getattr(args, "precompute_ref_log_probs", False):
        raise UserError("train.precompute_ref_log_probs: not for ERNIE-4.5-VL runs yet (the reference is scored in each step)")
    router, _ = router_losses(recipe, moe)
    split = recipe.distributed.sequence_parallel
    if split > 1:
        check_sequence_parallel(recipe, config, vl, args)
        if not planning and args.world_size == 1:  # a launch's count: refuse_unlaunchable above
            raise UserError(f"distributed.sequence_parallel: {split}: this run has 1 process; launch a multiple of "
                            f"{split} (`erniekit-lite train RECIPE --num-processes {split}`)")
    if cuda:
        choose_checkpointing(recipe, args, layout, free_bytes, log)
    offload = resolve_offload(recipe, args, layout, free_bytes, log, cuda, launch, host_check)
    head_trains = recipe.lora is None and recipe.method != "rm"  # LoRA leaves ERNIE's tied head frozen; rm has none
    return RunPlan(
        method=recipe.method,
        out=Path(recipe.output.dir),
        source=recipe.model.path,
        base=source.base,
        tokenizer=source.tokenizer,
        architecture=(getattr(config, "architectures", None) or [config.model_type])[0],
        moe=moe,
        vl=vl,
        vision_trains=vl and (recipe.lora.vision if recipe.lora is not None else recipe.model.train_vision),
        dtype=recipe.model.dtype,
        load_in_4bit=recipe.model.load_in_4bit,
        trust_remote_code=recipe.model.trust_remote_code,
        attention=resolve_attention(recipe.model.attn_implementation, recipe.data.packing, split > 1),
        seed=args.seed,
        lora=recipe.lora,
        lora_forward=lora_forward(recipe, this.zero3),
        checkpointing=bool(args.activation_checkpointing),
        checkpointing_by_plan=bool(getattr(args, CHECKPOINTING_OFF_BY_PLAN, False)),
        head_trains=head_trains,
        head_keep_positions=head_keep_positions(recipe, args, layout, free_bytes, log) if head_trains else 0,
        offload=offload,
        sync=recipe.distributed,
        sequence_parallel=split,
        compile_layers=recipe.model.compile_layers,
        compile_backend=args.torch_compile_backend,
        router={k: v for k, v in router.items() if moe},
        ema=recipe.train.get("ema"),
        expert_load=moe and recipe.output.expert_load,
        slow_bf16=not cuda and bool(getattr(args, "bf16", False)) and not cpu_has_bf16(),
        data=recipe.data,
        rewards=tuple(recipe.rewards or ()),
        sample_prompts=tuple(recipe.output.sample_prompts),
    )


def resolve_offload(recipe: Recipe, args, arch, free_bytes: int, log, cuda: bool, how: str,
                    host_check: bool = True) -> Applied:
    """train.offload as this run applies it, also kept on the Trainer arguments (`OFFLOAD_APPLIED`, which the
    optimizer reads); refuses, in one line, a run whose offloaded state would not fit the host (a mode the launch
    cannot apply: `refuse_unlaunchable`, first in `resolve`)."""
    mode = own_train(recipe, "offload")
    if mode == "none":
        return Applied("none", 0)
    if mode == "optimizer":
        check_optimizer(args)
    processes = args.world_size if how == "fsdp" else 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # the processes on this machine share its memory
    host = host_available()
    if mode == "auto":
        if not cuda:
            log("train.offload: auto: none (no GPU: everything is in host memory already)")
            return Applied("none", 0)
        modes = ("none", "parameters") if how == "fsdp" else ("none", "optimizer")
        mode, est, _ = choose_offload(recipe, args, arch, free_bytes, host // local, modes, processes)
        log(f"train.offload: auto: {mode} (the plan needs {memory.size(est.total)} on this GPU, {memory.size(free_bytes)} "
            "free" + (f"; {memory.size(est.host)} of host memory per process)" if est.host else ")"))
        if not fits(est, free_bytes) and how != "fsdp":
            log("train.offload: auto: the plan does not fit even so; train.offload: parameters (FSDP2's CPU offload, "
                "launched by `train`) holds only the layers in flight on the GPU (`erniekit-lite validate` shows it)")
        if mode == "none":
            return Applied("none", 0)
    else:
        est, _ = memory_estimate(recipe, args, arch, cuda=True, offload=mode, processes=processes)
    if host_check and est.host * local > host:
        raise UserError(f"train.offload: {mode} needs about {memory.size(est.host)} of host memory per process "
                        f"({local} on this machine), and {memory.size(host)} is available; free memory, run fewer "
                        "processes per machine, or shard over more (`erniekit-lite validate` shows the plan)")
    applied = Applied(mode, est.host)
    setattr(args, OFFLOAD_APPLIED, applied)
    return applied


def check_optimizer(args) -> None:
    """The host step runs torch's own optimizers (their state made lazily, on the masters): said before the model loads."""
    from transformers import Trainer

    cls, _ = Trainer.get_optimizer_cls_and_kwargs(args)
    if not getattr(cls, "__module__", "").startswith("torch.optim"):
        raise UserError(f"train.offload: optimizer steps torch's own optimizers on the CPU; train.optim "
                        f"{getattr(args.optim, 'value', args.optim)} is not one: use adamw_torch_fused (the default), "
                        "adamw_torch or sgd")


# --- the estimates and choices behind each decision (validate, plan.py, prints the same) ----------------------


def memory_estimate(recipe: Recipe, args, arch, cuda: bool, head_keep: bool = False, offload: str = "none",
                    processes: int = 1):
    """Peak accelerator memory per device (memory.py) for the run this recipe makes, on a CUDA GPU.

    `arch`: `architecture`'s dict, or a function returning it (read when an estimate is first made).
    `head_keep`: a trained LM head keeps its chunks' buffers instead of recomputing them (`head_keep_positions`).
    `offload`: train.offload as applied (none, optimizer, parameters), `processes` the FSDP2 processes sharing it.
    """
    from erniekit_lite.model.attention import resolve_attention
    from erniekit_lite.trainer_args import PAIR_METHODS

    capacity = recipe.data.max_length * (2 if recipe.method in PAIR_METHODS else 1)  # preference rows hold whole pairs
    split = recipe.distributed.sequence_parallel
    tokens = -(-args.per_device_train_batch_size * capacity // split)  # this process's share of the rows' tokens
    if cuda:
        autocast = bool(args.bf16 or args.fp16)
    else:  # the GPU default is bf16 autocast (training_args): assume it unless the recipe turns it off
        autocast = bool(recipe.train.get("bf16", True) or recipe.train.get("fp16", False))
    attn = recipe.model.attn_implementation
    if attn == "auto":
        attn = resolve_attention(attn, recipe.data.packing) if cuda else "sdpa"  # flash-attn may not be installed there
    kwargs = dict(args.activation_checkpointing_kwargs or {})
    scored = 0 if recipe.method == "rm" else tokens  # an upper bound: every position trained (rm: no LM head, one score per sequence)
    generation = {}
    if recipe.method in ("dpo", "kto"):
        reference = "adapter" if recipe.lora is not None else "precomputed" if args.precompute_ref_log_probs else "copy"
    elif recipe.method == "grpo":
        # a packed row of prompts and completions; the head runs at completion positions only
        capacity = recipe.data.max_length + args.max_completion_length
        tokens, scored = args.per_device_train_batch_size * capacity, args.per_device_train_batch_size * args.max_completion_length
        reference = "none" if args.beta == 0 else "adapter" if recipe.lora is not None else "copy"
        if not (args.use_vllm and args.vllm_mode == "server"):  # the server generates on its own GPUs
            generation = {"generate_sequences": args.generation_batch_size // max(1, args.world_size),
                          "generate_length": capacity}
    else:
        reference = "none"
    run = memory.Run(
        tokens=tokens,
        scored=scored,
        **generation,
        dtype_bytes=2 if recipe.model.dtype in ("bfloat16", "float16") else 4,
        autocast=autocast,
        load_in_4bit=recipe.model.load_in_4bit,
        checkpointing=bool(args.activation_checkpointing),
        every_n_layers=int(kwargs.get("every_n_layers", 1) or 1),
        offload=bool(kwargs.get("offload", False)),
        # PyTorch's varlen kernel keeps what flash attention keeps (its output is o_proj's input, no copy)
        attention="flash" if attn.startswith("flash") or attn == "packed_varlen" else "eager" if attn == "eager" else "sdpa",
        row_length=capacity,
        optim=str(getattr(args.optim, "value", args.optim)),
        method=recipe.method,
        reference=reference,
        chunk_elements=memory.MAX_CHUNK_ELEMENTS,
        head_keep=head_keep,
        ema=bool(recipe.train.get("ema")),
        host_offload=offload,
        processes=processes,
        sync=recipe.distributed.sync,
        sequence_parallel=split,
    )
    arch = arch() if callable(arch) else arch  # the run plan reads the model's layout only when a choice needs it
    return memory.estimate(arch["shape"], arch["memory"], run), run


def architecture(path: str, recipe: Recipe, config=None) -> dict:
    """Parameter counts from the config alone (`config`: the model's at `path`, read here when not given): the model
    is built on the meta device, no weights are read."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from erniekit_lite.model.source import read_config
    from erniekit_lite.model.vl import is_vl

    config = config if config is not None else read_config(path, recipe.model.trust_remote_code)
    auto = AutoModelForImageTextToText if is_vl(config) else AutoModelForCausalLM
    if recipe.method == "rm":  # the base's body under a new one-output `score` head (model/reward.py)
        from erniekit_lite.model.reward import AutoRewardModel as auto, check_start

        check_start(recipe.model.path)
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=recipe.model.trust_remote_code)
    total = sum(p.numel() for p in model.parameters())
    if is_vl(config) and recipe.lora is None and not recipe.model.train_vision:  # as load_for_training freezes it
        from erniekit_lite.model.vl import freeze_vision

        freeze_vision(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if recipe.lora is not None:
        from erniekit_lite.model.lora import apply_lora

        model = apply_lora(model, recipe.lora)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    from erniekit_lite.model.lora import groups_line, unwrap

    return {
        "groups": groups_line(model),
        "class": type(unwrap(model)).__name__,
        "parameters": total,
        "trainable": trainable,
        "shape": memory.Shape.from_config(config),
        "memory": memory.params_of(model, recipe.lora.dropout if recipe.lora is not None else 0.0),
    }


# The share of a device's (free) memory a plan may take, for every choice made against it (offload, activation
# checkpointing, keeping the LM head's chunks): the estimate's fragmentation allowance is itself a guess
HEADROOM = 0.85


OFFLOAD_APPLIED = "erniekit_offload"  # the Trainer arguments' attribute holding train.offload as applied (train/offload.py)


def fits(est, device_bytes: int) -> bool:
    return est.total <= HEADROOM * device_bytes


def gpu_free() -> int:
    import torch

    return torch.cuda.mem_get_info()[0]


def host_available() -> int:
    import psutil

    return psutil.virtual_memory().available


def choose_offload(recipe: Recipe, args, arch, device_bytes: int, host_bytes: int, modes: tuple[str, ...],
                   processes: int = 1, cuda: bool = True):
    """`train.offload: auto`: the first of `modes` whose plan fits the device (`HEADROOM` of `device_bytes`)
    and the host (`host_bytes`: what one process may take there); the last when none does. `processes`: the FSDP2
    processes the state is sharded over. (mode, estimate, run)."""
    for mode in modes:
        est, run = memory_estimate(recipe, args, arch, cuda, offload=mode, processes=processes)
        if fits(est, device_bytes) and est.host <= host_bytes:
            break
    return mode, est, run


# Set on the Trainer arguments when the plan turned checkpointing off: a first step that runs out of memory then turns
# it back on and runs that batch again (train/step.py, `ErnieTrainer.training_step`)
CHECKPOINTING_OFF_BY_PLAN = "erniekit_checkpointing_off_by_plan"


def choose_checkpointing(recipe: Recipe, args, arch, free_bytes: int, log=print) -> None:
    """Single-GPU runs whose recipe leaves activation checkpointing unset: off when the plan fits without it in the
    memory free on the device before the model loads (`free_bytes`: another process on the card counts).

    TRL turns it on by default, which recomputes every layer's forward in backward (about a third more compute)
    even where memory is plentiful, e.g. ERNIE-4.5-0.3B on one 80 GB GPU. A recipe that sets
    `train.activation_checkpointing` either way is left alone, and so are multi-process runs. A plan that never met
    this GPU may be low: turned off here, checkpointing comes back on if the first step runs out of memory.
    """
    if "activation_checkpointing" in recipe.train or "gradient_checkpointing" in recipe.train or args.world_size > 1:
        return
    if not args.activation_checkpointing:
        return
    args.activation_checkpointing = False
    est, _ = memory_estimate(recipe, args, arch, cuda=True)
    if fits(est, free_bytes):
        log(f"activation checkpointing off: the run needs about {est.total / memory.GIB:.1f} GiB without it, "
            f"{free_bytes / memory.GIB:.0f} GiB free on this GPU (set train.activation_checkpointing to choose)")
        setattr(args, CHECKPOINTING_OFF_BY_PLAN, True)
    else:
        args.activation_checkpointing = True


def head_keep_positions(recipe: Recipe, args, arch, free_bytes: int, log=print) -> int:
    """Full fine-tuning trains the LM head (ERNIE ties it to the embeddings). Its chunks' fp32 buffers can stay
    alive for backward (no recompute: a third less LM-head compute) or be recomputed there (one chunk's memory).
    Keep them when the plan with them kept, weights included, fits in the memory free before the model loads
    (`free_bytes`); the positions returned are the most a micro-batch can score (0: recompute). Runs of several
    processes always recompute, so every rank makes the same choice (and the plan below is not the sharded one)."""
    if args.world_size > 1:
        log("LM head: trained; its chunks are recomputed in backward (several processes: one choice for all ranks)")
        return 0
    # the run's own precision (cuda=True reads it from args; the CPU planning default assumes the GPU's autocast)
    est, run = memory_estimate(recipe, args, arch, cuda=True, head_keep=True)
    if fits(est, free_bytes):
        log(f"LM head: trained; its chunks are kept for backward, not recomputed (the run needs about "
            f"{est.total / memory.GIB:.1f} GiB with them kept, {free_bytes / memory.GIB:.0f} GiB free)")
        return run.tokens
    log(f"LM head: trained; its chunks are recomputed in backward (keeping them needs about {est.total / memory.GIB:.1f} "
        f"GiB, {free_bytes / memory.GIB:.0f} GiB free)")
    return 0
