"""`validate`: check a recipe and its data without training, and describe the run it would make: the memory plan for
a GPU, and the run plan `train` would resolve on this machine (run_plan.py, whose estimates both use); it never
imports `erniekit_lite.train` (tests/test_layout.py)."""

from __future__ import annotations

import math
from pathlib import Path

from erniekit_lite import memory, run_plan, words
from erniekit_lite.recipe import Recipe, own_train
from erniekit_lite.run_plan import architecture, choose_offload, fits, gpu_free, host_available, memory_estimate


def plan(recipe: Recipe, log=print, launch: run_plan.Launch | None = None) -> dict:
    """Check the recipe and its data and log the plan; returns its figures. The memory plan needs only the model's
    config: a model folder without a tokenizer (a config.json copied from a release) is planned with the data unread.
    `launch`: how `train` would launch the run (--num-processes, --accelerate-config): sharded, the plan per device."""
    from erniekit_lite.model import compile_layers
    from erniekit_lite.model.load import load_tokenizer
    from erniekit_lite.model.source import has_tokenizer, locate
    from erniekit_lite.trainer_args import router_losses, training_args

    import torch

    cuda = torch.cuda.is_available()
    gpu_notes = gpu_only_settings(recipe, cuda)
    # On a machine without a GPU, plan the GPU run anyway: what `train` would refuse here is a note, not an error
    args = training_args(recipe if cuda else without_gpu_settings(recipe), Path(recipe.output.dir))
    source = locate(recipe.model.path, recipe.model.trust_remote_code)  # first: its error names config.json
    arch = architecture(source.weights, recipe, source.config)
    if has_tokenizer(source.tokenizer):
        from erniekit_lite.model.vl import image_processor, is_vl

        images = image_processor(source.tokenizer) if is_vl(source.config) else None  # ERNIE-4.5-VL: image-text data
        info, data_lines = data_plan(recipe, args, load_tokenizer(source.tokenizer, recipe.model.trust_remote_code), log, images)
    else:
        images = None
        info, data_lines = unread_data_plan(recipe, args, source.tokenizer, log)
    info = {"architecture": arch["class"], "parameters": arch["parameters"], "trainable_parameters": arch["trainable"], **info}
    log(
        f"model: {arch['class']} ({recipe.model.path}), {arch['parameters']:,} parameters, "
        f"{arch['trainable']:,} trainable ({'LoRA r=%d' % recipe.lora.r if recipe.lora else 'full fine-tuning'})"
    )
    log(arch["groups"])
    router_line = router_losses(recipe, arch["shape"].experts > 0)[1]
    if router_line:
        log(router_line)
    for line in data_lines:
        log(line)
    offload = own_train(recipe, "offload")
    device = gpu_free() if cuda else memory.GPUS_GB[0] * memory.GIB  # this GPU, or the smallest GPU validate names
    if offload == "auto" and cuda:  # as `train` decides it (a plain run: none or optimizer), against this GPU
        offload, est, run = choose_offload(recipe, args, arch, device, host_available(), ("none", "optimizer"), cuda=cuda)
        log(f"train.offload: auto: {offload} ({'fits' if fits(est, device) else 'the most'} against "
            f"{device_name(device, cuda)}; `train` decides against the GPU it runs on)")
    elif offload == "auto":  # no GPU here: `train` would take none here; on a GPU, what it takes on each size
        log(f"train.offload: auto: none on this machine (no GPU); on a GPU `train` takes the first of none and optimizer "
            f"that fits it: {auto_by_gpu(recipe, args, arch)}; the plan below is with none")
        offload = "none"
        est, run = memory_estimate(recipe, args, arch, cuda, offload=offload)
    else:
        est, run = memory_estimate(recipe, args, arch, cuda, offload=offload)
    if recipe.distributed.sync != "every_step":
        log(f"{recipe.distributed.describe()}; applies when training runs in more than one process (DDP); "
            f"{memory.sync_memory(est, run)}")
    split = recipe.distributed.sequence_parallel
    if split > 1:
        log(sequence_line(split, arch["shape"], launch))
    gpu = memory.smallest_gpu(est.total)
    info["memory_gb"] = round(est.total / memory.GIB, 2)
    info["fits_gpu_gb"] = gpu
    info["offload"] = offload
    needed = est.total  # what each device of the launch needs: the headline
    if launch is not None and launch.processes > 1 and (launch.how == "fsdp" or launch.zero3):
        # under a sharding launch each device holds its share: that is the headline, one process's whole plan below it
        needed = memory.sharded_total(est, arch["memory"], run, launch.processes)
        info["memory_gb_sharded"] = round(needed / memory.GIB, 2)
        gpu = info["fits_gpu_gb"] = memory.smallest_gpu(needed)
        log(f"memory per device (estimate) under this launch, sharded over its {launch.processes} processes "
            f"({'FSDP' if launch.how == 'fsdp' else 'ZeRO-3'}): about {needed / memory.GIB:.1f} GiB; "
            f"{f'fits {memory.a_gpu(gpu)}' if gpu else f'does not fit one {memory.GPUS_GB[-1]} GB GPU'} (rough: the "
            "sharded states plus three gathered layers; not measured)")
        whole, *parts = memory.format_lines(est, run, memory.smallest_gpu(est.total))
        for line in [f"one process's plan, unsharded: {whole.removeprefix('memory per device (estimate): ')}", *parts]:
            log(f"  {line}")
    else:
        for line in memory.format_lines(est, run, gpu):
            log(line)
    if offload != "none":
        info["host_memory_gb"] = round(est.host / memory.GIB, 2)
        log(f"  {host_line(est.host)}")
    elif needed < est.total and needed > run_plan.HEADROOM * device:  # sharded: more processes make each share smaller
        log(f"note: about {needed / memory.GIB:.1f} GiB per device does not fit {device_name(device, cuda)}; more "
            "processes shard the states thinner")
    elif not fits(est, device):
        info["offload_proposed"] = propose_offload(recipe, args, arch, est, device, cuda, log)
    if recipe.method in ("orpo", "simpo"):
        info["memory_gb_as_dpo"] = round(log_saved_vs_dpo(recipe, args, arch, run, est, log) / memory.GIB, 2)
    if recipe.lora is None and recipe.method != "rm":  # a trained LM head (a reward model has none): `train` keeps its chunks instead of recomputing them when there is room
        kept, _ = memory_estimate(recipe, args, arch, cuda, head_keep=True)
        info["memory_gb_head_kept"] = round(kept.total / memory.GIB, 2)
        log(f"  LM head trains: the estimate recomputes its logit chunks in backward; keeping them instead (what train "
            f"does when the device has room, a third less LM-head compute) needs {kept.total / memory.GIB:.1f} GiB")
    if images is not None:  # ERNIE-4.5-VL
        from erniekit_lite.model.vl import vision_plan

        trained = recipe.lora is None or recipe.lora.vision
        log(f"  {vision_plan(source.config, images, trained, 4 if recipe.model.dtype == 'float32' else 2)}")
    log(compile_layers.describe(recipe.model.compile_layers, args.torch_compile_backend))
    if not cuda:
        log(f"  this machine has no CUDA GPU: `train` here runs on its CPU with mixed precision: {cpu_precision(recipe)} "
            "(the plan above is for the GPU run)")
    # The plan `train` resolves and runs, as it would resolve it on this machine (train/run.py prints the same lines)
    how = launch.how if launch is not None else "fsdp" if offload == "parameters" else "plain"  # `train` launches FSDP2 for it
    ran = run_plan.resolve(recipe, args, gpu_free() if cuda else host_available(), lambda *a: None, cuda, how, arch,
                           host_check=False, source=source)
    for line in ran.lines(" on this machine"):
        log(line)
    if gpu is None or (recipe.lora is None and gpu == memory.GPUS_GB[-1]):
        for n in (2, 4, 8, 16, 32, 64):
            per_device = memory.sharded_total(est, arch["memory"], run, n)
            if per_device <= 80 * memory.GIB:
                gpu_notes = gpu_notes + [
                    f"sharded over {n} GPUs (FSDP / DeepSpeed ZeRO-3: `train --num-processes {n} --accelerate-config "
                    f"recipes/accelerate/fsdp2.yaml`): about {per_device / memory.GIB:.0f} GiB per device (rough: the "
                    "sharded states plus three gathered layers; not measured)"
                ]
                break
    if gpu is None and split == 1 and recipe.data.packing and recipe.method in run_plan.SEQUENCE_METHODS:
        takes = ", ".join(map(str, memory.splits_of(arch["shape"].heads, arch["shape"].kv_heads)))
        gpu_notes = gpu_notes + [f"distributed.sequence_parallel: N splits each packed row over N processes (activations "
                                 f"and LM-head positions / N; this model takes N = {takes}; docs/distributed.md)"]
    if recipe.method == "grpo":
        gpu_notes = gpu_notes + grpo_notes(recipe, args, info.get("train_prompts"))
    if recipe.lora is not None and recipe.lora.use_dora:
        gpu_notes = gpu_notes + ["lora.use_dora: not in the estimate: peft forms each adapted weight's full matrix (and "
                                 "its norm) in that layer's forward and backward, one layer at a time; not measured"]
    for note in gpu_notes + est.notes:
        log(f"note: {note}")
    return info


def sequence_line(split: int, shape, launch: run_plan.Launch | None) -> str:
    """What `distributed.sequence_parallel` does to the plan, the processes it needs and the splits the model takes."""
    takes = ", ".join(map(str, memory.splits_of(shape.heads, shape.kv_heads)))
    processes = launch.processes if launch is not None and launch.processes > 1 else None
    groups = (f"{processes} processes = {processes // split} data-parallel group{'s' if processes // split > 1 else ''} "
              f"x {split}" if processes else f"launch a multiple of {split} processes: `train --num-processes {split}`")
    return (f"sequence parallel {split}: each process holds 1/{split} of every packed row's tokens and runs attention "
            f"for 1/{split} of the heads over the whole row (all-to-alls before and after); the estimate below is one "
            f"process's ({groups}); this model ({shape.heads} attention heads, {shape.kv_heads} key/value) takes "
            f"N = {takes}")


def auto_by_gpu(recipe: Recipe, args, arch: dict) -> str:
    """What `train.offload: auto` takes on each GPU size validate names, free of other processes: "none on an 80 GB
    GPU; optimizer on a 48 GB GPU; neither fits a 24 GB GPU" (sizes grouped by their choice)."""
    said: dict[str, list[int]] = {}
    for size in memory.GPUS_GB:
        mode, est, _ = choose_offload(recipe, args, arch, size * memory.GIB, host_available(), ("none", "optimizer"), cuda=False)
        said.setdefault(mode if fits(est, size * memory.GIB) else "neither", []).append(size)
    sizes = lambda gb: " or ".join(memory.a_gpu(g).removesuffix(" GPU") for g in gb) + " GPU"  # noqa: E731
    return "; ".join(f"neither fits {sizes(gb)}" if mode == "neither" else f"{mode} on {sizes(gb)}" for mode, gb in said.items())


def data_plan(recipe: Recipe, args, tokenizer, log, images=None) -> tuple[dict, list[str]]:
    """The data read and tokenized as training will: its figures, and the lines `validate` prints after the model's
    (what the data preparation says, and its description, are logged here as they come). `images`: a VL model's
    image processor (its image-text data read as `train` reads it)."""
    from erniekit_lite.data.prepare import describe_data, describe_pairs, prepare, prepare_pairs
    from erniekit_lite.trainer_args import PAIR_METHODS

    if recipe.method in PAIR_METHODS:
        if images is not None:
            from erniekit_lite.data.vl_rows import prepare_vl_pairs

            data = prepare_vl_pairs(recipe.data, tokenizer, images, seed=args.seed, log=log)
        else:
            data = prepare_pairs(recipe.data, tokenizer, seed=args.seed, log=log)
        describe, units = describe_pairs, "pairs"
        truncated, dropped = data.train.stats.truncated, sum(data.train.stats.skipped.values())
        count = len(data.train.pairs)
    elif recipe.method == "kto":
        from erniekit_lite.data.prepare import describe_feedback, prepare_feedback

        data = prepare_feedback(recipe.data, tokenizer, seed=args.seed, log=log, kl=args.loss_type != "apo_zero_unpaired")
        describe, units = describe_feedback, "examples"
        truncated, dropped = data.train.stats.truncated, sum(data.train.stats.skipped.values())
        count = len(data.train.examples)
    elif recipe.method == "grpo":
        from erniekit_lite.data.prompts import describe_prompts, prepare_prompts

        data = prepare_prompts(recipe.data, tokenizer, seed=args.seed, log=log)
        describe, units = describe_prompts, "prompts"
        truncated, dropped = 0, data.train.dropped_overlong
        count = len(data.train.items)
        log(rewards_line(recipe))
    elif recipe.method == "pt":
        from erniekit_lite.data.documents import describe_documents, prepare_documents

        data = prepare_documents(recipe.data, tokenizer, seed=args.seed, log=log)
        describe, units = describe_documents, "documents"
        truncated, dropped = data.train.stats.cut, data.train.stats.empty
        count = data.train.stats.documents
    else:
        if images is not None:
            from erniekit_lite.data.vl_rows import prepare_vl

            data = prepare_vl(recipe.data, tokenizer, images, seed=args.seed, log=log)
        else:
            data = prepare(recipe.data, tokenizer, seed=args.seed, log=log)
        describe, units = describe_data, "samples"
        truncated = data.train.stats.truncated
        dropped = data.train.stats.dropped_overlong + data.train.stats.dropped_untrained
        count = len(data.train.samples)

    lengths = sorted(data.train.lengths if recipe.method == "grpo" else data.train.stats.lengths)
    # GRPO's rows are completions: num_generations per prompt, scored as one packed row per micro-batch
    rows = count * args.num_generations if recipe.method == "grpo" else len(data.train.rows)
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)
    steps = args.max_steps if args.max_steps > 0 else math.ceil(rows / per_step) * math.ceil(args.num_train_epochs)
    info = {
        f"train_{units}": count,
        "length_mean": round(sum(lengths) / len(lengths), 1),
        "length_p95": lengths[min(len(lengths) - 1, int(0.95 * len(lengths)))],
        "length_max": lengths[-1],
        "truncated": truncated,
        "dropped": dropped,
        "rows": rows,
        "packing_efficiency": 1.0 if recipe.method == "grpo" else round(data.train.packing_efficiency, 4),
        "optimizer_steps": steps,
        "data_read": True,
    }
    if recipe.method == "kto":
        info["desirable"] = sum(e.desirable for e in data.train.examples)
        info["undesirable"] = count - info["desirable"]
    log(describe(data))
    lines = [
        f"tokens per {'piece' if recipe.method == 'pt' else 'sequence'}: mean {info['length_mean']}, p95 {info['length_p95']}, max {info['length_max']} "
        f"(max_length {recipe.data.max_length}); " + (f"{info['truncated']} documents cut into pieces, {info['dropped']} empty"
                                                       if recipe.method == "pt" else
                                                       f"{info['truncated']} truncated, {info['dropped']} dropped")
    ]
    if recipe.method == "grpo":
        lines.append(f"batches: {rows} completions per epoch ({count} prompts x {args.num_generations}), each micro-batch's "
                     f"{args.per_device_train_batch_size} scored as one packed row; {words.count(steps, 'optimizer step')} of {words.count(per_step, 'completion')}")
    else:
        lines.append(
            f"batches: {rows} {'packed rows' if recipe.data.packing else 'padded rows'}, packing efficiency "
            f"{info['packing_efficiency']:.1%}; {words.count(steps, 'optimizer step')} of {words.count(per_step, 'row')}"
        )
    return info, lines


def unread_data_plan(recipe: Recipe, args, tokenizer_dir: str, log) -> tuple[dict, list[str]]:
    """No tokenizer in the model folder: the data is not read. The memory plan never needed it (it counts every
    micro-batch's rows full, `memory_estimate`); the token statistics, rows and steps do, and are left out."""
    if recipe.method == "grpo":
        log(rewards_line(recipe))  # the rewards import without data
    steps = args.max_steps if args.max_steps > 0 else None
    counted = f"{words.count(steps, 'optimizer step')} (train.max_steps)" if steps else "no token statistics or step count"
    full = "as packed rows nearly are" if recipe.data.packing else "an upper bound for padded rows"
    line = (f"data: not read (no tokenizer at {tokenizer_dir}); the memory plan assumes every row full, data.max_length "
            f"{recipe.data.max_length:,} tokens per sequence, {full}; {counted}")
    return {"optimizer_steps": steps, "data_read": False}, [line]


def rewards_line(recipe: Recipe) -> str:
    """GRPO's rewards, each imported (one that cannot be fails here) and weighed."""
    from erniekit_lite.rewards import reward_functions

    funcs, _ = reward_functions(recipe.rewards, recipe.data.system)
    return f"rewards: {', '.join(f'{f.__name__} x {e.weight:g}' for f, e in zip(funcs, recipe.rewards))}"


def cpu_precision(recipe: Recipe) -> str:
    """The mixed precision `train` runs under on a machine without a GPU, as its `distributed:` line names it:
    bf16 autocast only when the recipe asks for it (`training_args`' CPU default is off; fp16 is refused there)."""
    return "bf16 autocast" if recipe.train.get("bf16") is True else "none"


def log_saved_vs_dpo(recipe: Recipe, args, arch: dict, run, est, log) -> int:
    """ORPO and SimPO have no reference: what DPO on the same rows would plan, and the pass it would add. Returns
    DPO's total."""
    import dataclasses

    reference = "adapter" if recipe.lora is not None else "copy"  # DPO's default (not precompute_ref_log_probs)
    dpo = memory.estimate(arch["shape"], arch["memory"], dataclasses.replace(run, method="dpo", reference=reference))
    held = "the no-grad reference pass (the adapter disabled)" if recipe.lora is not None else "a frozen copy of the model and its pass"
    log(f"  vs DPO on the same rows: DPO would plan {dpo.total / memory.GIB:.1f} GiB, {(dpo.total - est.total) / 2**20:,.0f} "
        f"MiB more for {held}, and one more no-grad forward of every row per step")
    return dpo.total


def grpo_notes(recipe: Recipe, args, prompts: int | None) -> list[str]:
    """What GRPO's steps are made of, and where its generation runs (`prompts` None: the data was not read)."""
    groups = args.generation_batch_size // args.num_generations
    notes = [f"grpo: each optimizer step trains on {args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)} "
             f"completions; generation makes {args.generation_batch_size} at a time ({groups} prompts x "
             f"{args.num_generations}), up to {args.max_completion_length} tokens each"
             + (f"; {prompts} prompts" if prompts is not None else "")]
    if args.use_vllm and args.vllm_mode == "server":
        notes.append(f"grpo: generation by the vLLM server at {args.vllm_server_base_url or f'{args.vllm_server_host}:{args.vllm_server_port}'} "
                     "(`trl vllm-serve`, its own environment and GPUs): not in this estimate")
    elif args.use_vllm:
        notes.append(f"grpo: vLLM colocated takes vllm_gpu_memory_utilization {args.vllm_gpu_memory_utilization:g} of the GPU "
                     "besides this estimate (its own weights and KV cache)")
    else:
        notes.append("grpo: generation by transformers' generate on this device (the estimate counts its KV cache); for "
                     "large models use vLLM's server mode (train.use_vllm, vllm_mode: server)")
    return notes


def gpu_only_settings(recipe: Recipe, cuda: bool) -> list[str]:
    """Settings `train` refuses on this machine, as notes (validate still plans the GPU run)."""
    notes = []
    if recipe.model.load_in_4bit:
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            notes.append("model.load_in_4bit: bitsandbytes is not installed; pip install 'erniekit-lite[qlora]'")
    if not cuda and recipe.train.get("fp16") is True:
        notes.append("train.fp16: true needs a CUDA GPU; this machine has none, so `train` would stop (train.bf16=true runs on CPU)")
    return notes


def without_gpu_settings(recipe: Recipe) -> Recipe:
    """The recipe without fp16, so the Trainer arguments can be built on a machine without a GPU."""
    changed = recipe.model_copy(deep=True)
    changed.train = {**changed.train, **({"fp16": False} if changed.train.get("fp16") is True else {})}
    return changed


def device_name(device_bytes: int, cuda: bool) -> str:
    if cuda:
        return f"this GPU's {device_bytes / memory.GIB:.0f} GiB free"
    return f"{memory.a_gpu(device_bytes // memory.GIB)} (the smallest GPU validate names, as no GPU is here)"


def host_line(need: int) -> str:
    """What the offloaded state needs in host memory per process, and whether this machine has it (validate never
    refuses for it)."""
    have = host_available()
    verdict = "fits" if need <= have else "does not fit: `train` would refuse here"
    return f"host memory: {memory.size(need)} per process; this machine has {memory.size(have)} available ({verdict})"


def propose_offload(recipe: Recipe, args, arch: dict, est, device_bytes: int, cuda: bool, log=print) -> str | None:
    """The plan does not fit the device (`device_bytes`): what each offload would need on the device and the host,
    and the plan with the first that fits; returns that mode (None when neither does)."""
    proposed = None
    # one line for the GPU the plan does not fit (the headline above says what it fits), then one per mode
    log(f"note: the plan ({est.total / memory.GIB:.1f} GiB) does not fit {device_name(device_bytes, cuda)}; "
        "what each train.offload would need there:")
    for mode in ("optimizer", "parameters"):
        with_it, run = memory_estimate(recipe, args, arch, cuda, offload=mode)
        how = "" if mode == "optimizer" else " (one FSDP2 process, launched by `train`; N processes divide the host memory)"
        log(f"  train.offload: {mode}{how}: {with_it.total / memory.GIB:.1f} GiB on the device "
            f"({'fits' if fits(with_it, device_bytes) else 'does not fit either'}), {host_line(with_it.host)}")
        if proposed is None and fits(with_it, device_bytes):
            proposed = mode
    if proposed is not None:
        with_it, run = memory_estimate(recipe, args, arch, cuda, offload=proposed)
        log(f"with train.offload: {proposed}:")
        for line in memory.format_lines(with_it, run, memory.smallest_gpu(with_it.total)):
            log(f"  {line}")
    return proposed


