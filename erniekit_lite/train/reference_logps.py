"""Reference log-probs computed once before training (`train.precompute_ref_log_probs`): DPO's and KTO's shared pass.

The rows hold a variable number of pairs or examples, so values come back as one list per row (as TRL 1.16's
`_precompute_ref_logps` would store them for its padded rows), and:
- rows are sharded contiguously: rank r scores rows [r*n//W, (r+1)*n//W) (at most ceil(n/W) each), in batches of
  `batch_size` rows through the trainer's collator; each rank's (rank, row, values) triples are all-gathered and put
  back in row order (every row exactly once, checked);
- a rank with fewer rows than ceil(n/W) scores one more: a repeat of a row, whose values are dropped. Every rank then
  runs the same number of forwards, which a sharded model (FSDP2 reference, ZeRO-3) needs: each forward is collective;
- under ZeRO-3 without a separate reference, the policy runs in a DeepSpeed inference engine (reference.py; its
  module hooks gather each layer's parameters for its forward), built once;
- values are cached on disk (`<cache>/reference/<key>.npz`, beside data/cache.py's `data/`) under a key of everything
  that decides them (`cache_key`: the same for any number of processes and strategy), so a second run, or a
  `--resume`, reads them instead of scoring again; `data.cache: false` turns it off, and entries unused for
  `cache.KEEP_DAYS` are removed whenever one is written, as for the data cache.
Rank 0 prints one line saying which: the rows each rank scored, or the entry reused.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Callable

import torch

from erniekit_lite import words
from erniekit_lite.data import cache
from erniekit_lite.files import for_user
from erniekit_lite.model.attention import take_batch_lengths

FORMAT = 1  # bump when the entry layout changes


def cache_folder() -> Path:
    return cache.cache_dir().parent / "reference"


def precompute(trainer, reference, dataset, name: str, batch_size: int, score: Callable, per_row: Callable[[dict], int],
               settings: dict, cached: bool = True):
    """`dataset` with one column per name `score(model, batch)` returns under the `reference` (reference.py), each a
    list per row: `score` gives 1-D tensors over the batch's pairs or examples in collator order, `per_row(row)` how
    many of them a row holds. `settings`: what else changes the values (the loss's own options); `cached`: the
    recipe's `data.cache`."""
    accelerator = trainer.accelerator
    key = cache_key(trainer, reference, dataset, settings) if cached else None
    path = cache_folder() / f"{key}.npz" if cached else None
    stored = [load(path, key, len(dataset)) if cached and accelerator.is_main_process else None]
    if accelerator.num_processes > 1:  # rank 0 decides, so all ranks take the same branch (collectives below)
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(stored, from_process=0)
    columns = stored[0]
    if columns is not None:
        say(accelerator, f"reference log-probs ({name}): {words.count(len(dataset), 'row')} reused from {path}")
    else:
        columns, shards = _score(trainer, reference, dataset, batch_size, score, per_row)
        if accelerator.is_main_process:
            try:
                if not cached:
                    raise OSError("data.cache: false")
                save(path, key, columns)
                where = f"cached in {path}"
            except OSError as e:
                where = f"not cached ({e})"
            say(accelerator, f"reference log-probs ({name}): {words.count(len(dataset), 'row')} scored, "
                             f"{' + '.join(map(str, shards))} on {len(shards)} process{'es' if len(shards) > 1 else ''}; {where}")
        accelerator.wait_for_everyone()
    for column, values in columns.items():
        dataset = dataset.add_column(column, values)
    return dataset


def precompute_datasets(trainer, reference, score, per_row, settings: dict, cached: bool) -> None:
    """The train (and eval) rows with the reference's values as columns (`precompute`), in the trainer's
    datasets; a copy loaded only for this (FSDP) is dropped after."""
    args = trainer.args
    trainer.train_dataset = precompute(
        trainer, reference, trainer.train_dataset, "train", args.precompute_ref_batch_size or args.per_device_train_batch_size,
        score, per_row, settings, cached)
    if trainer.eval_dataset is not None:
        trainer.eval_dataset = precompute(
            trainer, reference, trainer.eval_dataset, "eval", args.precompute_ref_batch_size or args.per_device_eval_batch_size,
            score, per_row, settings, cached)
    reference.model = None


def say(accelerator, line: str) -> None:
    if accelerator.is_main_process:
        print(line, flush=True)


def shard(n: int, rank: int, world: int) -> range:
    """This rank's contiguous slice of n rows: sizes differ by at most one, none above ceil(n / world)."""
    return range(rank * n // world, (rank + 1) * n // world)


def _score(trainer, reference, dataset, batch_size: int, score: Callable, per_row: Callable) -> tuple[dict, list[int]]:
    from accelerate.utils import gather_object
    from torch.utils.data import DataLoader, Subset

    accelerator, n = trainer.accelerator, len(dataset)
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = list(shard(n, rank, world))
    # every rank runs ceil(n / world) rows: a sharded model's forward is collective (the repeat's values are dropped)
    padded = mine + [mine[0] if mine else 0] * (math.ceil(n / world) - len(mine))
    loader = DataLoader(Subset(dataset, padded), batch_size=batch_size, collate_fn=_Counted(trainer.data_collator, per_row),
                        shuffle=False, num_workers=trainer.args.dataloader_num_workers, pin_memory=trainer.args.dataloader_pin_memory)
    model = reference.scoring_model(trainer)
    results, at = [], 0
    for counts, batch in loader:
        batch = {k: v.to(accelerator.device) if torch.is_tensor(v) else v for k, v in batch.items() if k not in ("token_slots", "row_units")}
        take_batch_lengths(batch)
        values = {k: v.float().cpu().tolist() for k, v in reference(model, accelerator, batch, score).items() if v is not None}
        if any(len(v) != sum(counts) for v in values.values()):
            raise RuntimeError(f"reference pass: {sorted(map(len, values.values()))} values for {sum(counts)} pairs or examples")
        start = 0
        for row, count in zip(padded[at:at + len(counts)], counts):
            if at < len(mine):  # not the repeat
                results.append((rank, row, {k: v[start:start + count] for k, v in values.items()}))
            at, start = at + 1, start + count
    gathered = gather_object(results) if world > 1 else results
    gathered.sort(key=lambda item: item[1])
    if [row for _, row, _ in gathered] != list(range(n)):
        raise RuntimeError(f"reference pass: {len(gathered)} rows came back for {n}")
    shards = [sum(r == k for r, _, _ in gathered) for k in range(world)]
    names = list(gathered[0][2]) if gathered else []
    return {k: [values[k] for _, _, values in gathered] for k in names}, shards


class _Counted:
    """The trainer's collator, also saying how many pairs or examples each row of the batch holds."""

    def __init__(self, collator, per_row: Callable[[dict], int]):
        self.collator, self.per_row = collator, per_row

    def __call__(self, rows: list[dict]) -> tuple[list[int], dict]:
        return [self.per_row(row) for row in rows], self.collator(rows)


def cache_key(trainer, reference, dataset, settings: dict) -> str:
    """Everything that decides the values: the rows' content, how they are collated, the reference model (its path,
    class, config, adapters' configs and a digest of every weight and buffer it holds: a full pass with xxh3, split
    across ranks, seconds even for 21B, where a key of path + config alone would reuse the values of a model since
    retrained in place), the precision, the loss's `settings`, and the code and library versions that score them.
    The same on every rank and for any number of processes (ZeRO-3 and FSDP shards are gathered to hash)."""
    import peft
    import transformers

    model = trainer.accelerator.unwrap_model(reference.model if reference.model is not None else trainer.model)
    config = model.config
    collator = trainer.data_collator
    parts = {
        "format": FORMAT,
        "code": _code_digest(),
        "versions": [torch.__version__, transformers.__version__, peft.__version__],
        "rows": rows_digest(dataset),
        "collator": [type(collator).__name__, vars(collator)],
        "model": {
            "path": getattr(config, "_name_or_path", ""),
            "class": _model_class(model).__name__,
            "config": config.to_dict(),
            "attention": config._attn_implementation,
            "adapters": {k: v.to_dict() for k, v in (getattr(model, "peft_config", None) or {}).items()},
            "weights": weights_digest(model, trainer.accelerator),
        },
        "precision": {"bf16": trainer.args.bf16, "fp16": trainer.args.fp16},
        "settings": settings,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=_jsonable).encode()).hexdigest()[:40]


def _jsonable(value):
    """Sets (peft's `target_modules`) sorted: str() of a set follows the process's hash seed, which differs per
    process and per run."""
    return sorted(map(str, value)) if isinstance(value, (set, frozenset)) else str(value)


def _model_class(model) -> type:
    """The model's own class: FSDP2's `fully_shard` swaps it for a subclass `FSDP<name>(FSDPModule, <name>)`, and the
    scoring forward (train/scored.py) is a subclass too, in either order; neither may change the key (a 1-process run
    and an FSDP2 launch score the same values)."""
    from torch.distributed.fsdp import FSDPModule

    from erniekit_lite.train.scored import SCORED

    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule) and not vars(cls).get(SCORED))


def _code_digest() -> str:
    """The package's source: any change to how rows are collated or scored gives new keys."""
    h = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    for source in sorted(package.rglob("*.py")):
        h.update(str(source.relative_to(package)).encode() + b"\0" + source.read_bytes())
    return h.hexdigest()


def rows_digest(dataset) -> str:
    """xxh3 of every column of the rows in dataset order (list lengths, then values, through Arrow)."""
    import pyarrow as pa
    import xxhash  # a dependency of datasets

    h = xxhash.xxh3_128()
    table = dataset.with_format("arrow")[:]  # in dataset order, whatever indices mapping it carries

    def add(array) -> None:
        if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
            h.update(array.value_lengths().fill_null(-1).to_numpy(zero_copy_only=False).astype("int64").tobytes())
            add(array.flatten())
        elif pa.types.is_integer(array.type) or pa.types.is_floating(array.type) or pa.types.is_boolean(array.type):
            h.update(array.to_numpy(zero_copy_only=False).tobytes())
        else:
            h.update(json.dumps(array.to_pylist(), default=str).encode())

    for name in sorted(table.column_names):
        h.update(name.encode() + b"\0" + str(table.schema.field(name).type).encode() + b"\0")
        add(table.column(name).combine_chunks())
    return h.hexdigest()


def weights_digest(model, accelerator) -> str:
    """A digest of every parameter and buffer's name, dtype, shape and bytes. Tensor i is hashed on rank i % W; a
    ZeRO-3 partition or FSDP2 shard is gathered first (on every rank: collective)."""
    from accelerate.utils import gather_object

    rank, world = accelerator.process_index, accelerator.num_processes
    tensors = sorted({**dict(model.named_parameters()), **dict(model.named_buffers())}.items())
    mine = []
    for i, (name, tensor) in enumerate(tensors):
        with _whole(tensor) as whole:
            if i % world == rank:
                mine.append((i, _tensor_digest(name, whole)))
    everyone = sorted(gather_object(mine) if world > 1 else mine)
    if [i for i, _ in everyone] != list(range(len(tensors))):
        raise RuntimeError("reference pass: the ranks' models hold different tensors")
    return hashlib.sha256("".join(d for _, d in everyone).encode()).hexdigest()


class _whole:
    """The tensor whole for the block: a ZeRO-3 parameter gathered (DeepSpeed's GatheredParameters), a DTensor's
    `full_tensor()`, else the tensor itself."""

    def __init__(self, tensor):
        self.tensor, self.gathered = tensor, None

    def __enter__(self):
        if hasattr(self.tensor, "ds_id"):
            import deepspeed

            self.gathered = deepspeed.zero.GatheredParameters([self.tensor], modifier_rank=None)
            self.gathered.__enter__()
            return self.tensor.data
        from torch.distributed.tensor import DTensor

        return self.tensor.full_tensor() if isinstance(self.tensor, DTensor) else self.tensor

    def __exit__(self, *exc):
        if self.gathered is not None:
            self.gathered.__exit__(*exc)


def _tensor_digest(name: str, tensor: torch.Tensor) -> str:
    import xxhash

    h = xxhash.xxh3_128(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
    h.update(tensor.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save(path: Path, key: str, columns: dict[str, list[list[float]]]) -> None:
    """Each column's values flat (float32, as scored) with its row bounds; written whole or not at all."""
    import numpy as np

    arrays = {"meta": np.frombuffer(json.dumps({"key": key, "columns": sorted(columns)}).encode(), dtype=np.uint8)}
    for name, rows in columns.items():
        arrays[f"{name}.values"] = np.asarray([v for row in rows for v in row], dtype=np.float32)
        arrays[f"{name}.bounds"] = np.cumsum([0] + [len(row) for row in rows], dtype=np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        for_user(Path(tmp))  # as the data cache's entries
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    cache.prune_unused(path.parent)  # entries unused for cache.KEEP_DAYS, as for the data cache


def load(path: Path, key: str, rows: int) -> dict[str, list[list[float]]] | None:
    """The entry's columns, or None when there is none or it does not hold `rows` rows under `key` (then removed)."""
    if not path.is_file():
        return None
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes())
            columns = {}
            for name in meta["columns"]:
                values, bounds = z[f"{name}.values"].tolist(), z[f"{name}.bounds"].tolist()
                if len(bounds) != rows + 1 or bounds[-1] != len(values):
                    raise ValueError("inconsistent entry")
                columns[name] = [values[a:b] for a, b in zip(bounds, bounds[1:])]
        if meta["key"] != key:
            raise ValueError("entry under the wrong key")
    except Exception:  # a damaged entry is scored again, never used
        try:
            path.unlink(missing_ok=True)
        except OSError:  # a read-only shared cache: just not used
            pass
        return None
    try:
        os.utime(path)  # last used: what pruning goes by
    except OSError:  # a read-only shared cache still serves its entries
        pass
    return columns
