"""`distributed.sequence_parallel: N`: the run's processes in groups of N consecutive ranks, each group sharing
its rows' tokens (model/sequence_parallel.py says how, data/sequence_shard.py how a batch is cut).

Processes = data-parallel groups x N. The data is sharded over the data-parallel groups only: every process of a
group reads the same batches (the training and evaluation dataloaders' batch samplers, as accelerate prepares them,
take the group's index and the group count); gradients are reduced over all processes as DDP and FSDP2 do. Groups are
consecutive ranks, so on several machines a group stays within one machine's fast link.
"""

from __future__ import annotations

import functools

from erniekit_lite.classes import same_named
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
    for model in (trainer.model, getattr(trainer, "ref_model", None)):  # a full-FT DPO/KTO reference scores alike
        if model is not None:
            unwrap(model).sequence_group = group
    trainer.sequence_parallel = n
    trainer.accelerator.__class__ = data_parallel_class(type(trainer.accelerator))
    trainer.accelerator.sequence_parallel = n
    log(describe(n, world))


def describe(n: int, processes: int) -> str:
    groups = processes // n
    return (f"sequence parallel: {n} processes share each row ({processes} processes = {groups} data-parallel "
            f"group{'s' if groups > 1 else ''} x {n}); each holds 1/{n} of a row's tokens, attention all-to-all over heads")


@functools.cache
def data_parallel_class(cls: type) -> type:
    """accelerate's Accelerator class `cls` whose `prepare_data_loader` (public, overridden) shards batches over the
    data-parallel groups: the batch sampler accelerate makes takes the group's index and the group count."""
    from accelerate.data_loader import BatchSamplerShard

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        prepared = cls.prepare_data_loader(self, data_loader, device_placement, slice_fn_for_dispatch)
        sampler = getattr(prepared, "batch_sampler", None)
        if not isinstance(sampler, BatchSamplerShard):
            raise UserError("distributed.sequence_parallel: this dataloader is not sharded by batches (an iterable "
                            "dataset, or accelerate's dispatch_batches); use a map-style dataset")
        sampler.num_processes = self.num_processes // self.sequence_parallel
        sampler.process_index = self.process_index // self.sequence_parallel
        return prepared

    return same_named(cls, __name__, prepare_data_loader=prepare_data_loader, sequence_parallel=1)
