"""Start-up of a launched run (issue 30, item 4): only each machine's main process tokenizes (sft, pairs, pt pieces,
GRPO prompts), the others read what it wrote (the cache entry, or a hand-off beside the run dir, removed afterwards);
the MoE expert-load statistics gather the frozen correction bias once, not once per layer and forward."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from helpers import IDENTITY, PAIRS

SCENARIOS = {  # name: (kind of data, cache on with every file cacheable?)
    "sft, cache off": ("sft", False),
    "sft, cache on": ("sft", True),
    "pairs, cache off": ("pairs", False),
    "pt, cache off": ("pt", False),
    "pt, cache on": ("pt", True),
    "grpo prompts": ("grpo", False),
}


def _data(kind: str, cache_on: bool, documents: str) -> dict:
    source = {"sft": IDENTITY, "grpo": IDENTITY, "pairs": PAIRS, "pt": documents}[kind]
    return {"train": [str(source)], "max_length": 64, "cache": cache_on}


def _prepare(section: dict, tokenizer, kind: str, log, beside: Path | None = None):
    """What each kind of data prepared: the token ids and labels (pt: of each packed row; grpo: each prompt's
    messages, answer and length)."""
    from erniekit_lite.data.documents import prepare_documents
    from erniekit_lite.data.prepare import prepare, prepare_pairs
    from erniekit_lite.data.prompts import prepare_prompts
    from erniekit_lite.recipe import DataSection

    prepare_kind = {"sft": prepare, "pairs": prepare_pairs, "pt": prepare_documents, "grpo": prepare_prompts}[kind]
    data = prepare_kind(DataSection(**section), tokenizer, log=log, beside=beside)
    if kind == "pairs":
        return [[s.input_ids, s.labels] for p in data.train.pairs for s in (p.chosen, p.rejected)]
    if kind == "pt":
        return [[r.input_ids, r.labels] for r in data.train.rows]
    if kind == "grpo":
        return [[i.messages, i.answer, i.length] for i in data.train.items]
    return [[s.input_ids, s.labels] for s in data.train.samples]


def _counting(counted: list):
    """Counting stand-in for the tokenizer: every text `Tokenizer.encode` is given (all kinds of data go through it)."""
    from erniekit_lite.data.tokenize import Tokenizer

    real = Tokenizer.encode

    def encode(self, texts, *args, **kwargs):
        counted.append(len(texts))
        return real(self, texts, *args, **kwargs)

    return encode


def _worker(rank: int, port: int, tokenizer_dir: str, run_dir: str, results: str, documents: str) -> None:
    """One of 2 processes, as `accelerate launch` starts them on one machine (gloo, CPU): accelerate's state first (the
    Trainer arguments make it in a run), then each scenario's `prepare` with `beside=` the run dir, as run.py calls it."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    from accelerate import PartialState

    from erniekit_lite.data import cache
    from erniekit_lite.data.tokenize import Tokenizer
    from erniekit_lite.model.load import load_tokenizer

    state = PartialState(cpu=True)
    cache.MIN_BYTES = 0  # "cache on": the demo files are cached
    counted = []
    Tokenizer.encode = _counting(counted)
    tokenizer = load_tokenizer(tokenizer_dir)
    out = {}
    for name, (kind, cache_on) in SCENARIOS.items():
        counted.clear()
        said = []
        items = _prepare(_data(kind, cache_on, documents), tokenizer, kind, said.append, Path(run_dir))
        out[name] = {"tokenized": sum(counted), "items": items, "said": said}
    Path(results, f"{rank}.json").write_text(json.dumps(out))
    state.wait_for_everyone()
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # ~20-40 s on 2 cores: two spawned processes importing torch and transformers
def test_only_the_main_process_tokenizes_and_the_other_reads_what_it_wrote(tmp_path, monkeypatch, tiny_own_dir):
    from erniekit_lite.data.tokenize import Tokenizer
    from erniekit_lite.model.load import load_tokenizer

    monkeypatch.setenv("ERNIEKIT_CACHE", str(tmp_path / "cache"))  # the workers inherit it: an empty cache
    documents = tmp_path / "documents.jsonl"  # pt: documents longer than max_length are cut into several pieces
    documents.write_text("".join(json.dumps({"text": f"Document {i}: " + "words to learn " * (3 + 9 * i)}) + "\n"
                                 for i in range(6)))
    parent = tmp_path / "runs"
    run_dir, results = parent / "run", tmp_path / "results"
    results.mkdir()
    torch.multiprocessing.start_processes(_worker, (_free_port(), str(tiny_own_dir), str(run_dir), str(results), str(documents)),
                                          nprocs=2, start_method="spawn")
    main, other = (json.loads((results / f"{rank}.json").read_text()) for rank in (0, 1))

    # What one process alone makes and tokenizes (cache off: nothing read back)
    counted = []
    monkeypatch.setattr(Tokenizer, "encode", _counting(counted))
    tokenizer = load_tokenizer(str(tiny_own_dir))
    for name, (kind, _) in SCENARIOS.items():
        counted.clear()
        alone = _prepare(_data(kind, False, str(documents)), tokenizer, kind, print)
        assert main[name]["items"] == other[name]["items"] == json.loads(json.dumps(alone)), name
        assert main[name]["tokenized"] == sum(counted) > 0, name
        assert other[name]["tokenized"] == 0, name
    assert len(main["pt, cache off"]["items"]) > 1 and max(len(r[0]) for r in main["pt, cache off"]["items"]) == 64

    handed = "data: tokenized samples of {} read from this machine's main process"
    assert other["sft, cache off"]["said"][-1] == handed.format(IDENTITY)
    assert other["pairs, cache off"]["said"][-1] == handed.format(PAIRS)
    assert other["pt, cache off"]["said"][-1] == f"data: tokenized pieces of {documents} read from this machine's main process"
    detected = f"{IDENTITY}: prompt format auto-detected as 'erniekit'"
    assert other["grpo prompts"]["said"] == [detected, f"data: prompts of {IDENTITY} read from this machine's main process"]
    assert main["grpo prompts"]["said"] == [detected]
    assert other["pt, cache off"]["said"][0] == main["pt, cache off"]["said"][0] == \
        f"{documents}: pre-training format auto-detected as 'text'"
    assert other["sft, cache on"]["said"][-1].startswith(f"data cache: tokenized samples of {IDENTITY} reused (")
    assert other["pt, cache on"]["said"][-1].startswith(f"data cache: tokenized pieces of {documents} reused (")
    for name in SCENARIOS:
        assert not any("read from this machine's main process" in line for line in main[name]["said"]), name
    # The hand-offs were beside the run dir (its parent), and are gone; the run dir itself was never made
    assert list(parent.iterdir()) == []
    assert len(list((tmp_path / "cache" / "data").glob("*.npz"))) == 1  # the cached sft scenario's one entry
    assert len(list((tmp_path / "cache" / "data").glob("pt-*"))) == 1  # the cached pt scenario's piece folder


class _CountingBias:
    """Stand-in for an FSDP2 shard of the frozen correction bias: `full_tensor()` (an all-gather there) is counted."""

    requires_grad = False

    def __init__(self, values: torch.Tensor, gathers: list):
        self.values, self.gathers = values, gathers

    def full_tensor(self) -> torch.Tensor:
        self.gathers.append(1)
        return self.values


def test_expert_load_gathers_each_frozen_correction_bias_once(tmp_path):
    """Three counted forwards over two MoE layers: 2 gathers in all (one per layer, at the first count), where a
    gather per layer and forward made 6; the counts use the bias (it changes the top-k here)."""
    from types import SimpleNamespace

    from erniekit_lite.train.expert_load import ExpertLoad

    gathers, experts = [], 4
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for bias in ([0.0, 0.0, 0.0, 5.0], [5.0, 0.0, 0.0, 0.0]):
        layer = torch.nn.Module()
        layer.mlp = torch.nn.Module()
        layer.mlp.gate = torch.nn.Module()
        layer.mlp.gate.top_k, layer.mlp.gate.num_experts = 1, experts
        layer.mlp.gate.moe_statics = SimpleNamespace(e_score_correction_bias=_CountingBias(torch.tensor([bias]), gathers))
        model.layers.append(layer)
    load = ExpertLoad(model)
    assert load.layers == [0, 1]
    logits = [torch.tensor([[4.0, 0.0, 0.0, 0.0], [0.0, 4.0, 0.0, 0.0]])] * 2  # unbiased: experts 0 and 1
    for _ in range(3):
        load.add(logits)
    assert len(gathers) == 2
    assert load.counts.tolist() == [[0, 0, 0, 6], [6, 0, 0, 0]]


def test_a_trained_correction_bias_is_read_at_every_count():
    """Only a frozen bias is kept: one that trains (not ERNIE's, `freeze_router_statistics`) is read each time."""
    from types import SimpleNamespace

    from erniekit_lite.train.expert_load import ExpertLoad

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    gate = torch.nn.Module()
    gate.top_k, gate.num_experts = 1, 2
    gate.moe_statics = SimpleNamespace(e_score_correction_bias=torch.nn.Parameter(torch.tensor([[0.0, 5.0]])))
    model.layers[0].mlp = torch.nn.Module()
    model.layers[0].mlp.gate = gate
    load = ExpertLoad(model)
    load.add([torch.tensor([[4.0, 0.0]])])
    with torch.no_grad():
        gate.moe_statics.e_score_correction_bias.fill_(0.0)
    load.add([torch.tensor([[4.0, 0.0]])])
    assert load.counts.tolist() == [[1, 1]]
