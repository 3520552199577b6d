"""Weighted mixing of training sources (`data.train[].weight`): counts, seeded draws, and the mix as SFT, DPO and
pre-training see it."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from erniekit_lite.data import mixing
from erniekit_lite.data.documents import prepare_documents
from erniekit_lite.data.prepare import describe_data, prepare, prepare_pairs
from erniekit_lite.errors import DataError, RecipeError
from erniekit_lite.model.load import load_tokenizer
from erniekit_lite.recipe import DataSection, from_dict
from helpers import PAIRS


def quiet(*_):
    pass


def test_realised_shares_are_the_weights_within_one_item_on_a_large_mix():
    sizes, weights = [37, 50_000, 7_000, 2_963], [0.1, 0.5, 0.3, 0.1]
    n = sum(sizes)
    picked = mixing.draw(sizes, weights, seed=3)
    assert sum(len(p) for p in picked) == n  # the epoch keeps the sources' total
    for indices, size, weight in zip(picked, sizes, weights):
        assert abs(len(indices) / n - weight) <= 1 / n  # largest-remainder rounding: within one item of N x weight
        assert all(0 <= i < size for i in indices)
        uses = Counter(indices)
        whole, rest = divmod(len(indices), size)
        # a source below its share repeats whole, then a subset; above it, a subsample: never one item 2 more times than another
        assert max(uses.values()) - min(uses.values(), default=0) <= 1 and len(uses) == (size if whole else rest)
    assert mixing.draw(sizes, weights, seed=3) == picked  # same seed, same mix
    assert mixing.draw(sizes, weights, seed=4) != picked
    assert mixing.counts([3, 3, 3], [1, 1, 1]) == [3, 3, 3] and mixing.counts([1, 1], [2, 1]) == [1, 1]  # shares 2/3, 1/3 of 2
    assert mixing.shares([2, 6]) == [0.25, 0.75]


def write(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


def test_sft_mix_reports_samples_and_token_shares(tmp_path, tiny_own_dir):
    tokenizer = load_tokenizer(str(tiny_own_dir))
    short = write(tmp_path / "short.jsonl", [{"instruction": f"q{i}", "output": "a"} for i in range(40)])
    long = write(tmp_path / "long.jsonl", [{"instruction": f"question {i}", "output": "a long answer " * 10} for i in range(10)])
    data = DataSection(train=[{"path": short, "weight": 1}, {"path": long, "weight": 3}], max_length=256)
    prepared = prepare(data, tokenizer, seed=0, log=quiet)
    assert len(prepared.train.samples) == 50
    short_report, long_report = prepared.train.sources
    assert (short_report.drawn, long_report.drawn) == (13, 37)  # 12.5 and 37.5: equal remainders, the earlier source first
    lengths = Counter(len(s) for s in prepared.train.samples)
    tokens = sum(len(s) for s in prepared.train.samples)
    long_tokens = sum(n * c for n, c in lengths.items() if n > 20)
    assert long_report.token_share == pytest.approx(long_tokens / tokens)
    assert short_report.token_share + long_report.token_share == pytest.approx(1)
    described = describe_data(prepared)
    assert f"long.jsonl [alpaca (auto)]: 10 records -> 10 samples; mixed in: 37 samples, {long_report.token_share:.1%} of the tokens" in described
    again = prepare(data, tokenizer, seed=0, log=quiet)
    assert [s.input_ids for s in again.train.samples] == [s.input_ids for s in prepared.train.samples]
    unweighted = prepare(DataSection(train=[short, long], max_length=256), tokenizer, log=quiet)
    assert len(unweighted.train.samples) == 50 and unweighted.train.sources[0].drawn is None


def test_dpo_and_pt_mix(tmp_path, tiny_own_dir):
    tokenizer = load_tokenizer(str(tiny_own_dir))
    pairs = prepare_pairs(DataSection(train=[{"path": str(PAIRS), "weight": 1}, {"path": str(PAIRS), "weight": 1, "max_samples": 2}],
                                      max_length=128), tokenizer, seed=0, log=quiet)
    total = sum(r.samples for r in pairs.train.sources)
    assert len(pairs.train.pairs) == total and [r.drawn for r in pairs.train.sources] == [total // 2, total - total // 2]
    a = write(tmp_path / "a.jsonl", [{"text": "alpha gamma"} for _ in range(6)])
    b = write(tmp_path / "b.jsonl", [{"text": "beta"} for _ in range(2)])
    docs = prepare_documents(DataSection(train=[{"path": a, "weight": 1}, {"path": b, "weight": 1}], max_length=64, cache=False),
                             tokenizer, seed=0, log=quiet)
    assert docs.train.rows.count == 8 and [r.drawn for r in docs.train.sources] == [4, 4]  # b's 2 pieces, each twice


def test_bad_weights_are_one_line(tmp_path, tiny_own_dir):
    def recipe_error(data: dict) -> str:
        with pytest.raises(RecipeError) as e:
            from_dict({"model": {"path": "m"}, "data": data, "output": {"dir": "o"}})
        return str(e.value)

    assert "weight is set on some training sources but not on data.train.1 (b.jsonl)" in recipe_error(
        {"train": [{"path": "a.jsonl", "weight": 2}, "b.jsonl"]})
    assert "evaluation sources are used whole" in recipe_error({"train": [{"path": "a.jsonl", "weight": 1}],
                                                                 "eval": [{"path": "b.jsonl", "weight": 1}]})
    assert "give evaluation data as data.eval instead" in recipe_error({"train": [{"path": "a.jsonl", "weight": 1}], "eval_split": 0.1})
    assert "Input should be greater than 0" in recipe_error({"train": [{"path": "a.jsonl", "weight": 0}]})
    empty = write(tmp_path / "empty.jsonl", [{"instruction": "q " * 500, "output": "a"}])  # longer than max_length: dropped
    with pytest.raises(DataError, match="empty.jsonl: weight 1 is set but nothing in this source is left to train on"):
        prepare(DataSection(train=[{"path": str(PAIRS.parent / "identity.jsonl"), "weight": 1}, {"path": empty, "weight": 1}],
                            max_length=128, overlong="drop"), load_tokenizer(str(tiny_own_dir)), log=quiet)
