"""Shared fixtures: the real ERNIE 4.5 tokenizer from ../shared and tiny random ERNIE 4.5 models.

`ERNIEKIT_SHARED` points at the shared reference files (default: ../shared beside the repository). A test that needs
something absent (those files, llama.cpp, vLLM, chromium, an optional package) is skipped, saying what and how to
get it, except under CI=true (as .ci/run sets): CI installs all of it, so there a missing one fails the test
(`missing`, `needs`, `optional`), and a broken install can never pass as a green run of skips.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# Each xdist worker (and the processes its tests start) takes its share of the cores for torch's and OpenMP's
# threads: left at every core each, two workers' thread pools contend on the same 2 cores, and six in-process
# training files took 170 s instead of 104 s (docs/development.md). A value set by hand is kept.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))


def missing(what: str, how: str):
    """The test needs `what`, which is absent: fail under CI, else skip (a module-level call skips the module)."""
    if IN_CI:
        pytest.fail(f"CI=true, but {what} is missing ({how})", pytrace=False)
    pytest.skip(f"{what} missing ({how})", allow_module_level=True)


def needs(present: bool, what: str, how: str):
    """A mark: the test (or, as `pytestmark`, the module) runs when `present`, else `missing(what, how)` at setup."""
    return pytest.mark.needs(present=bool(present), what=what, how=how)


# .ci/run builds the engines (llama.cpp, vLLM) in the background while the tests run, and names the file that build
# writes its exit status to when it ends: the tests that need an engine run last and wait for it
ENGINES_PENDING = os.environ.get("ERNIEKIT_ENGINES_PENDING")
ENGINES_WAIT = 3600  # seconds: the build takes 4-10 minutes on 2 cores, beside the tests


def needs_engine(present, what: str, how: str):
    """`needs` for a test that uses an engine .ci/run may still be building: `present` is a callable, asked at setup
    once that build has ended; such a test's module runs after every other module."""
    return pytest.mark.needs(present=present, what=what, how=how, engine=True)


def _engines_built() -> None:
    import time

    deadline = time.monotonic() + ENGINES_WAIT
    done = Path(ENGINES_PENDING)
    while not done.is_file() or not done.read_text().strip():
        if time.monotonic() > deadline:
            pytest.fail(f"the engines building in the background (.ci/run) did not finish in {ENGINES_WAIT} s", pytrace=False)
        time.sleep(5)
    if done.read_text().strip() != "0":
        pytest.fail(f"the engines' background build failed (.ci/run): see {done.parent}/llama-cpp-build.log and "
                    "vllm-build.log", pytrace=False)
    importlib.invalidate_caches()  # llama_cpp was installed into this venv while the tests ran


def _needs_an_engine(item) -> bool:
    return any(mark.kwargs.get("engine") for mark in item.iter_markers("needs"))


# The longest files (`--durations`, docs/development.md), started first, so that the two xdist workers (whole files
# each) end together instead of one finishing a long file alone
LONGEST_FIRST = ("test_distributed.py", "test_step_weights.py", "test_multinode.py", "test_webui_e2e.py", "test_memory.py",
                 "test_gpu_check.py", "test_reference_precompute.py", "test_webui_jobs.py")


def pytest_collection_modifyitems(config, items):
    """The longest modules first; the modules with a test that needs an engine last (each module's tests kept together
    and in order, so its fixtures are made once): under .ci/run, the engines build while everything else runs."""
    late = {item.module for item in items if _needs_an_engine(item)}

    def rank(item):
        name = Path(item.module.__file__).name
        return (2 if item.module in late else 0 if name in LONGEST_FIRST else 1,
                LONGEST_FIRST.index(name) if name in LONGEST_FIRST else 0)

    items[:] = sorted(items, key=rank)  # stable: collection order within each module and rank


def optional(name: str):
    """The module `name`, or None when it is not installed (the tests that use it carry `needs(... is not None)`)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


TEST_EXTRA = "pip install -e '.[test]'"


def need_module(name: str, how: str = TEST_EXTRA):
    """The module `name`; `missing` when it is not installed."""
    module = optional(name)
    if module is None:
        missing(f"the Python package {name!r}", how)
    return module


def chromium() -> Path | None:
    """A chromium to drive, found as Playwright or a shell would: on PATH (Debian's `chromium`), else the one
    `playwright install chromium` put in Playwright's browser folder."""
    import glob
    import shutil

    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return Path(found)
    folder = os.environ.get("PLAYWRIGHT_BROWSERS_PATH") or str(Path.home() / ".cache" / "ms-playwright")
    found = sorted(glob.glob(os.path.join(folder, "chromium-*", "chrome-linux*", "chrome")))
    return Path(found[-1]) if found else None


def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs"):
        present = mark.kwargs["present"]
        if mark.kwargs.get("engine"):
            if ENGINES_PENDING:
                _engines_built()
            present = present()
        if not present:
            missing(mark.kwargs["what"], mark.kwargs["how"])

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


@pytest.fixture(autouse=True)
def _images_anywhere(monkeypatch):
    """A web UI built in a test's process confines data records' images to its folder through the environment
    (webui/gate.py, ERNIEKIT_IMAGES_INSIDE): put back after each test, so the next test's data reads are not."""
    monkeypatch.setenv("ERNIEKIT_IMAGES_INSIDE", "")


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


SHARED_HOW = "set ERNIEKIT_SHARED, or put the shared reference files beside the repository"
needs_shared = needs(ERNIE_TOKENIZER_DIR.is_dir(), f"the shared reference files at {SHARED}", SHARED_HOW)


@pytest.fixture(scope="session")
def ernie_tokenizer_dir(tmp_path_factory) -> Path:
    """The real tokenizer, re-saved once as tokenizer.json (loads in ~1 s instead of ~6 s from sentencepiece)."""
    if not ERNIE_TOKENIZER_DIR.is_dir():
        missing(f"the shared reference files at {SHARED}", SHARED_HOW)
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


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory) -> Path:
    """Tiny ERNIE-4.5-VL with the project's own small tokenizer (the VL tokens added): fast to run."""
    from erniekit_lite.tiny import write_tiny

    return write_tiny(str(tmp_path_factory.mktemp("tiny-vl")), "vl", None, hidden_size=64, layers=3)
