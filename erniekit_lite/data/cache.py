"""Tokenized samples kept on disk between runs, so a second `train` or `validate` on the same data skips tokenizing.

Where: `$ERNIEKIT_CACHE/data` when ERNIEKIT_CACHE is set, else `$XDG_CACHE_HOME/erniekit-lite/data`, else
`~/.cache/erniekit-lite/data` (the XDG convention, as pip and huggingface_hub follow; HF_HOME is left to
Hugging Face's own files). Delete the folder to reclaim space; `data.cache: false` in a recipe turns it off.

Key: a SHA-256 over everything that can change a sample (`entry_key`):
- each data file's bytes (xxh3-128: 86 MB hash in 0.05 s). Content rather than size + mtime: a copied,
  re-downloaded or checked-out file gets a new mtime but the same samples, and an edit that keeps the size
  within the same second must still miss;
- the tokenizer's full serialized state (vocabulary, merges, added tokens, normalizer) and its chat template;
- the template chosen, and every data setting that reaches tokenization (the caller's `settings`);
- the source code of `erniekit_lite/data/` and the transformers and tokenizers versions, so a change in how
  samples are made can never be answered by an entry made the old way.
Only local files are cached: a Hub dataset id names data that can change upstream without a local signal, and
`datasets` already caches its download.

Entry: one `.npz` file (token ids and labels concatenated as int32, about 8 bytes per token; sample boundaries;
JSON metadata), written to a temporary file and renamed into place, so a reader sees a whole entry or none. An
entry that fails to load (truncated, corrupt, under the wrong key) is ignored, removed and rebuilt. Entries
unused for 30 days are removed whenever a new one is written. numpy rather than an Arrow dataset: the caller
needs Python lists, and `ndarray.tolist()` plus slicing is the fastest way back to them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

from erniekit_lite.data.tokenize import Sample
from erniekit_lite.files import for_user

FORMAT = 2  # bump when the entry layout or the tokenization changes (2: message text in a model's own template is text)
# Inputs smaller than this tokenize in well under a second: not worth a disk entry (and test runs stay out of it)
MIN_BYTES = 1 << 20
KEEP_DAYS = 30  # entries unused this long are removed whenever a new one is written


def cache_dir() -> Path:
    root = os.environ.get("ERNIEKIT_CACHE")
    if root:
        return Path(root).expanduser() / "data"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "erniekit-lite" / "data"


def local_files(paths: list[str]) -> list[Path] | None:
    """The files, when every path is a local file together at least MIN_BYTES; else None (not cached)."""
    files = [Path(p).expanduser() for p in paths]
    if not all(f.is_file() for f in files) or sum(f.stat().st_size for f in files) < MIN_BYTES:
        return None
    return files


def file_digest(path: Path) -> str:
    import xxhash  # a dependency of datasets

    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_digest(tokenizer) -> str:
    """A digest of everything in the tokenizer that decides token ids, and of its chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = backend.to_str()  # vocabulary, merges, added tokens, normalizer, pre-tokenizer: 0.2 s for ERNIE 4.5
    else:
        from datasets.fingerprint import Hasher  # a slow (Python) tokenizer: hash the whole object

        state = Hasher.hash(tokenizer)
    h = hashlib.sha256()
    for part in (type(tokenizer).__name__, getattr(tokenizer, "chat_template", None) or "", state):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def _code_digest() -> str:
    import tokenizers
    import transformers

    h = hashlib.sha256(f"{FORMAT}\0{transformers.__version__}\0{tokenizers.__version__}\0".encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        h.update(source.name.encode() + b"\0" + source.read_bytes())
    return h.hexdigest()


def entry_key(kind: str, files: list[Path], tokenizer_hash: str, settings: dict) -> str:
    """The entry's name: `kind` ("sft", "dpo"), the files' contents, the tokenizer and the settings (JSON-able)."""
    parts = {
        "kind": kind,
        "code": _code_digest(),
        "files": [file_digest(f) for f in files],
        "tokenizer": tokenizer_hash,
        "settings": settings,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:40]


@dataclass
class Entry:
    samples: list[Sample]
    meta: dict  # the caller's statistics and source reports, as JSON


def load(key: str, root: Path | None = None) -> Entry | None:
    """The entry under `key`, or None when there is none or it cannot be read whole (then it is removed)."""
    path = (root or cache_dir()) / f"{key}.npz"
    if not path.is_file():
        return None
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as z:  # zip members carry CRCs: a damaged file raises here
            meta = json.loads(z["meta"].tobytes())
            ids, labels = z["ids"].tolist(), z["labels"].tolist()
            bounds, truncated = z["bounds"].tolist(), z["truncated"].tolist()
        if meta.get("key") != key or len(bounds) != len(truncated) + 1 or bounds[-1] != len(ids) or len(ids) != len(labels):
            raise ValueError("inconsistent entry")
    except Exception:  # any damage means rebuilding; a partial entry must never be used
        _remove(path)
        return None
    samples = [Sample(ids[a:b], labels[a:b], t) for a, b, t in zip(bounds, bounds[1:], truncated)]
    try:
        os.utime(path)  # last used: what pruning goes by
    except OSError:  # a read-only shared cache still serves its entries
        pass
    return Entry(samples, meta["meta"])


def store(key: str, entry: Entry, root: Path | None = None, prune: bool = True) -> Path:
    """Write the entry atomically (temporary file in the same folder, then rename), then prune entries unused for
    KEEP_DAYS (`prune`: only in a folder of entries). Raises OSError when the folder cannot be written."""
    import numpy as np

    folder = root or cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    count = sum(len(s.input_ids) for s in entry.samples)
    arrays = {
        "ids": np.fromiter(chain.from_iterable(s.input_ids for s in entry.samples), dtype=np.int32, count=count),
        "labels": np.fromiter(chain.from_iterable(s.labels for s in entry.samples), dtype=np.int32, count=count),
        "bounds": np.cumsum([0] + [len(s.input_ids) for s in entry.samples], dtype=np.int64),
        "truncated": np.asarray([s.truncated for s in entry.samples], dtype=bool),
        "meta": np.frombuffer(json.dumps({"key": key, "meta": entry.meta}).encode(), dtype=np.uint8),
    }
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        for_user(Path(tmp))  # mkstemp's 0600 would keep a shared cache folder's entries from its other users
        os.replace(tmp, folder / f"{key}.npz")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if prune:
        prune_unused(folder)
    return folder / f"{key}.npz"


def prune_unused(folder: Path) -> None:
    """Remove entries (and temporary files of interrupted writes) not used for KEEP_DAYS: a new tokenizer, new
    settings or a new erniekit-lite version leaves the old entries unreachable."""
    cutoff = time.time() - KEEP_DAYS * 86400
    for path in [*folder.glob("*.npz"), *folder.glob(".*.tmp")]:
        try:
            if path.stat().st_mtime < cutoff:
                _remove(path)
        except OSError:  # another process removed it first
            pass


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:  # not ours to remove (read-only shared cache): it is just not used
        pass
