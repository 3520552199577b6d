"""Shared fixtures: the real ERNIE 4.5 tokenizer from ../shared and tiny random ERNIE 4.5 models.

`ERNIEKIT_SHARED` points at the shared reference files (default: ../shared beside the repository); tests that
need them are skipped when they are absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("ERNIEKIT_SHARED", ROOT.parent / "shared"))
ERNIE_TOKENIZER_DIR = SHARED / "ernie45" / "ernie-4.5-0.3b-base-pt"
DATA_DIR = SHARED / "data"

@pytest.fixture
def one_thread():
    """torch on one thread for the test: tiny ops on a shared 2-core machine are steadier and often faster so."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _private_data_cache(tmp_path_factory):
    """Tests never write into (or read from) the user's own data cache (erniekit_lite/data/cache.py)."""
    old = os.environ.get("ERNIEKIT_CACHE")
    os.environ["ERNIEKIT_CACHE"] = str(tmp_path_factory.mktemp("erniekit-cache"))
    yield
    if old is None:
        os.environ.pop("ERNIEKIT_CACHE", None)
    else:
        os.environ["ERNIEKIT_CACHE"] = old


needs_shared = pytest.mark.skipif(not ERNIE_TOKENIZER_DIR.is_dir(), reason=f"shared reference files not found at {SHARED}")


@pytest.fixture(scope="session")
def ernie_tokenizer_dir(tmp_path_factory) -> Path:
    """The real tokenizer, re-saved once as tokenizer.json (loads in ~1 s instead of ~6 s from sentencepiece)."""
    if not ERNIE_TOKENIZER_DIR.is_dir():
        pytest.skip(f"shared reference files not found at {SHARED}")
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("ernie-tokenizer")
    AutoTokenizer.from_pretrained(ERNIE_TOKENIZER_DIR).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def ernie_tokenizer(ernie_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ernie_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_dense_dir(tmp_path_factory, ernie_tokenizer_dir) -> Path:
    """Tiny dense ERNIE 4.5 with the real tokenizer."""
    from erniekit_lite.tiny import write_tiny

    return write_tiny(str(tmp_path_factory.mktemp("tiny-dense")), "dense", str(ernie_tokenizer_dir), hidden_size=64, layers=2)


@pytest.fixture(scope="session")
def tiny_own_dir(tmp_path_factory) -> Path:
    """Tiny dense ERNIE 4.5 with the project's own small tokenizer (no shared files needed)."""
    from erniekit_lite.tiny import write_tiny

    return write_tiny(str(tmp_path_factory.mktemp("tiny-own")), "dense", None, hidden_size=64, layers=2)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory) -> Path:
    from erniekit_lite.tiny import write_tiny

    return write_tiny(str(tmp_path_factory.mktemp("tiny-moe")), "moe", None, hidden_size=64, layers=3)
