"""`distributed.sequence_parallel: N`: the run's processes in groups of N consecutive ranks, each group sharing
its rows' tokens (model/sequence_parallel.py says how, data/sequence_shard.py how a batch is cut).

Processes = data-parallel groups x N. The data is sharded over the data-parallel groups only: every process of a
group reads the same batches (the training and evaluation dataloaders' batch samplers, as accelerate prepares them,
take the group's index and the group count: `by_groups`, called by the step's dataloaders, train/step.py); gradients
are reduced over all processes as DDP and FSDP2 do. Groups are
consecutive ranks, so on several machines a group stays within one machine's fast link.
"""

from __future__ import annotations

from erniekit_lite.data.sequence_shard import SequenceShard
from erniekit_lite.errors import UserError
from erniekit_lite.model.lora import unwrap
from erniekit_lite.model.sequence_parallel import SequenceGroup


def setup(trainer, n: int, log=print) -> None:
    """Cut every batch for this process, give the model(s) their group, shard the data over the groups."""
    if n == 1:
        return
    import torch.distributed as dist

    world, rank = trainer.args.world_size, trainer.args.process_index
    groups = [dist.new_group(list(range(first, first + n))) for first in range(0, world, n)]  # every process makes each
    group = SequenceGroup(groups[rank // n], rank % n, n)
    trainer.data_collator = SequenceShard(trainer.data_collator, n, rank % n)
    reference = getattr(getattr(trainer, "loss", None), "reference", None)  # a full-FT DPO/KTO reference scores alike
    for model in (trainer.model, getattr(reference, "model", None)):
        if model is not None:
            unwrap(model).sequence_group = group
    trainer.sequence_parallel = n  # read by the step's dataloaders (`by_groups`) and token counts
    log(describe(n, world))


def describe(n: int, processes: int) -> str:
    groups = processes // n
    return (f"sequence parallel: {n} processes share each row ({processes} processes = {groups} data-parallel "
            f"group{'s' if groups > 1 else ''} x {n}); each holds 1/{n} of a row's tokens, attention all-to-all over heads")


def by_groups(loader, accelerator, n: int):
    """A dataloader accelerate prepared, its batches sharded over the data-parallel groups: the batch sampler takes
    the group's index and the group count."""
    from accelerate.data_loader import BatchSamplerShard

    sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, BatchSamplerShard):
        raise UserError("distributed.sequence_parallel: this dataloader is not sharded by batches (an iterable "
                        "dataset, or accelerate's dispatch_batches); use a map-style dataset")
    sampler.num_processes = accelerator.num_processes // n
    sampler.process_index = accelerator.process_index // n
    return loader
