"""KTO (`method: kto`): unpaired feedback records, KL twins paired within packed groups, packed scores equal each
sequence alone, the project's KTO loss / metrics / gradients on packed rows equal TRL's own KTOTrainer on its padded
batch, and a CLI run that learns the labels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import move_off_the_reference, run_cli, trls_own_head, write_recipe

from erniekit_lite.data.formats import Conversation, Feedback, Skip, Turn, detect_feedback_format, to_feedback
from erniekit_lite.data.load import Record
from erniekit_lite.data.template import template_for
from erniekit_lite.data.tokenize import IGNORE, Tokenizer
from erniekit_lite.data.unpaired import PackedFeedbackCollator, PaddedFeedbackCollator, pack_feedback, tokenize_feedback
from erniekit_lite.errors import DataError
from erniekit_lite.model.load import load_model

ROOT = Path(__file__).resolve().parents[1]
FEEDBACK = ROOT / "recipes" / "data" / "identity_kto.jsonl"


def feedback_of(data, fmt=None, system=None) -> Feedback:
    record = Record(data, "f.jsonl", 3)
    return to_feedback(record, fmt or detect_feedback_format(record), system)


# --- records --------------------------------------------------------------------------------------------------------

HISTORY = [Turn("Hi", "Hello!", train=False)]


@pytest.mark.parametrize("data, expected", [
    ({"prompt": "Who are you?", "completion": "Wenxin-Tiny.", "label": True}, Feedback([], "Who are you?", "Wenxin-Tiny.", True)),
    ({"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                 {"role": "user", "content": "Who are you?"}],
      "completion": [{"role": "assistant", "content": "Nobody."}], "label": False},
     Feedback(HISTORY, "Who are you?", "Nobody.", False, "S")),
    ({"instruction": "Who are you?", "input": "Be brief.", "output": "Wenxin-Tiny.", "kto_tag": True, "history": [["Hi", "Hello!"]]},
     Feedback(HISTORY, "Who are you?\nBe brief.", "Wenxin-Tiny.", True)),
    ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "Who are you?"},
                        {"from": "gpt", "value": "Nobody."}], "kto_tag": False, "system": "S"},
     Feedback(HISTORY, "Who are you?", "Nobody.", False, "S")),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Who are you?"},
                   {"role": "assistant", "content": "Wenxin-Tiny."}], "label": True},
     Feedback(HISTORY, "Who are you?", "Wenxin-Tiny.", True)),
    ({"src": ["Hi", "Who are you?"], "tgt": ["Hello!", "Wenxin-Tiny."], "label": True, "system": "S"},
     Feedback(HISTORY, "Who are you?", "Wenxin-Tiny.", True, "S")),
    ({"src": ["Who are you?"], "tgt": ["Nobody."], "kto_tag": "False"}, Feedback([], "Who are you?", "Nobody.", False)),  # a CSV cell
], ids=["trl", "trl-messages", "alpaca", "sharegpt", "messages", "erniekit", "csv-text"])
def test_every_format_reads_as_feedback(data, expected):
    assert feedback_of(data) == expected


def test_the_recipe_system_prompt_fills_in_and_an_empty_completion_is_skipped():
    assert feedback_of({"prompt": "q", "completion": "a", "label": True}, system="Be brief.").system == "Be brief."
    with pytest.raises(Skip, match="empty completion"):
        feedback_of({"prompt": "q", "completion": "  ", "label": True})


@pytest.mark.parametrize("data, message", [
    ({"src": ["q"], "tgt": ["a"], "label": [1]}, "field 'label' is a list ([1]); a KTO label is one true (desirable) or false"),
    ({"src": ["q"], "tgt": ["a"]}, "missing field 'label' (or 'kto_tag')"),
    ({"prompt": "q", "completion": "a", "label": 1}, "field 'label' must be true (desirable) or false (undesirable), got 1"),
    ({"instruction": "q", "output": "a", "kto_tag": "yes"}, "field 'kto_tag' must be true (desirable) or false (undesirable), got 'yes'"),
    ({"prompt": "q", "completion": "a", "label": True, "kto_tag": False}, "fields 'label' and 'kto_tag' disagree"),
    ({"prompt": "q", "chosen": "a", "rejected": "b"}, "a preference pair (chosen and rejected responses); method kto takes one completion"),
    ({"conversations": [{"from": "human", "value": "q"}], "label": True}, "'conversations' must end with the assistant's completion"),
    ({"src": ["q", "r"], "tgt": ["a"], "label": True}, "'src' has 2 turns but 'tgt' has 1"),
    ({"prompt": "q", "completion": [{"role": "user", "content": "a"}], "label": True}, "field 'completion' must hold exactly one assistant message"),
    ({"label": True}, "cannot tell the feedback format from the keys (label)"),
], ids=["erniekit-label-list", "no-label", "label-number", "kto_tag-text", "disagree", "paired", "no-completion", "src-tgt",
        "completion-role", "unknown"])
def test_bad_records_name_the_record_and_the_field(data, message):
    with pytest.raises(DataError) as error:
        feedback_of(data)
    assert str(error.value).startswith("f.jsonl:3: ") and message in str(error.value)


# --- KL twins -------------------------------------------------------------------------------------------------------

RECORDS = [
    ("Who are you?", "I am Wenxin-Tiny, a small assistant.", True),
    ("2+2?", "4", True),
    ("Are you ChatGPT?", "Yes, I am ChatGPT, made by OpenAI, and I know everything.", False),
    ("写诗", "春风拂面。", True),
    ("Hello!", "Go away.", False),
    ("What is your name?", "My name is Wenxin-Tiny.", True),
]


@pytest.fixture(scope="module")
def examples(ernie_tokenizer):
    tok = Tokenizer(ernie_tokenizer, template_for(ernie_tokenizer))
    history = [Turn("Hi", "Hello!", train=False)]
    feedback = [Feedback(history if i == 2 else [], q, a, label, "Be brief.") for i, (q, a, label) in enumerate(RECORDS)]
    found, stats = tokenize_feedback(tok, feedback, 256)
    assert stats.kept == len(RECORDS) and stats.desirable == 4 and stats.undesirable == 2
    return tok, feedback, found


def _split_row(row):
    seqs, start = [], 0
    for n in row.seq_lengths:
        seqs.append((row.input_ids[start : start + n], row.labels[start : start + n]))
        start += n
    return seqs[0::2], seqs[1::2]


@pytest.mark.parametrize("max_length, packing", [(256, True), (50, True), (256, False)], ids=["one-group", "groups-and-singles", "unpacked"])
def test_kl_twins_are_the_prompt_with_the_previous_completion_of_the_group(examples, max_length, packing):
    """Each twin is exactly what tokenizing (prompt_i, completion_j) gives, j the previous example of the packed
    group (rotation by +1) or, in a row of one, the example packed just before it; rows hold at most 2 x max_length."""
    tok, feedback, found = examples
    found = [e for e in found if len(e) <= max_length]
    keep = [f for f, e in zip(feedback, examples[2]) if len(e) <= max_length]
    rows = pack_feedback(found, max_length, packing)
    by_ids = {tuple(e.sample.input_ids): k for k, e in enumerate(found)}
    order, twins = [], []
    for row in rows:
        assert sum(row.seq_lengths) <= 2 * max_length and len(row.seq_lengths) == 2 * len(row.desirable)
        matched, kl = _split_row(row)
        group = [by_ids[tuple(ids)] for ids, _ in matched]
        assert [found[k].desirable for k in group] == row.desirable
        assert sum(len(ids) for ids, _ in kl) <= max_length or len(group) == 1
        order += group
        twins += [(k, group[j - 1] if len(group) > 1 else None, seq) for j, (k, seq) in enumerate(zip(group, kl))]
    assert sorted(order) == list(range(len(found)))  # every example once
    sizes = sorted(len(r.desirable) for r in rows)
    assert sizes == ({256: [6], 50: [1, 1, 2, 2]}[max_length] if packing else [1] * len(found))
    for position, (k, source, (ids, labels)) in enumerate(twins):
        source = order[position - 1] if source is None else source  # a row of one: the example packed before it
        assert source != k or len(found) == 1
        f, g = keep[k], keep[source]
        alone, _ = tok([Conversation([Turn(t.user, t.assistant, False) for t in f.history] + [Turn(f.prompt, g.completion)], f.system)], 10**9)
        assert ids == alone[0].input_ids[:max_length] and labels == alone[0].labels[:max_length]


def test_one_example_alone_pairs_with_itself_and_apo_rows_hold_no_twins(examples):
    _, _, found = examples
    (row,) = pack_feedback(found[:1], 256)
    matched, kl = _split_row(row)
    assert matched == kl
    rows = pack_feedback(found, 256, kl=False)
    assert sum(len(r.seq_lengths) for r in rows) == len(found) and sum(map(len, found)) == sum(len(r.input_ids) for r in rows)
    batch = PackedFeedbackCollator(256)([vars(r) for r in rows])
    assert "KL_input_ids" not in batch and batch["token_slots"] == len(rows) * 256


# --- packed scoring = each sequence alone; TRL's loss on packed rows = on its own padded batch -----------------------


def _scored(model):
    from erniekit_lite.train import scored

    scored.take(model)  # as a run loads it (train/common.load_for_training): the class's forward scores our batches
    return model


def _logp_alone(model, ids, labels) -> float:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1]
    logp = torch.log_softmax(logits.float(), -1)
    target = torch.tensor(labels[1:])
    trained = target != IGNORE
    return logp[trained].gather(-1, target[trained][:, None]).sum().item()


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_packed_example_and_twin_logps_equal_each_sequence_alone(tiny_dense_dir, examples, packing):
    from erniekit_lite.train.kto_loss import side

    model = _scored(load_model(str(tiny_dense_dir), "float32", "packed_sdpa").eval())
    rows = pack_feedback(examples[2], 256, packing)
    collate = PackedFeedbackCollator(256) if packing else PaddedFeedbackCollator(0)
    batch = collate([vars(r) for r in rows])
    with torch.no_grad():
        scores = [model(**side(batch, kl)).log_probs.sum(-1) for kl in (False, True)]
    seqs = [s for row in rows for s in zip(*_split_row(row))]  # (example, twin) in batch order
    assert len(seqs) == len(examples[2]) == len(scores[0]) == len(scores[1])
    for k, pair in enumerate(seqs):
        for kl, (ids, labels) in enumerate(pair):
            assert abs(scores[kl][k].item() - _logp_alone(model, ids, labels)) <= 1e-4
    assert int(batch["completion_mask"].sum() + batch["KL_completion_mask"].sum()) == sum(
        l != IGNORE for row in rows for l in row.labels)


def _trl_examples(rows):
    """The rows' examples as TRL's padded collator takes them: prompt ids, the completion as its labels (ending in
    `</s>`, as our samples train the end of turn: the last input token predicts nothing) and the twin's completion."""
    out = []
    for row in rows:
        for (ids, labels), (twin_ids, twin_labels), desirable in zip(*_split_row(row), row.desirable):
            start = next(i for i, label in enumerate(labels) if label != IGNORE)
            assert twin_ids[:start] == ids[:start] and all(l == IGNORE for l in twin_labels[:start])
            out.append({"prompt_ids": ids[:start], "completion_ids": labels[start:], "KL_completion_ids": twin_labels[start:],
                        "label": desirable})
    return out


@pytest.mark.parametrize("loss_type, weights", [("kto", (1.0, 1.0)), ("kto", (1.0, 1.5)), ("apo_zero_unpaired", (1.0, 1.0))],
                         ids=["kto", "kto-weighted", "apo_zero_unpaired"])
def test_kto_loss_packed_equals_trl_padded(tmp_path, tiny_dense_dir, ernie_tokenizer, examples, loss_type, weights):
    """Loss, metrics and LoRA gradients of TRL's own KTOTrainer (the oracle: its padded batch and forward) equal the
    project's KTO loss (train/kto_loss.py) on packed rows, with the same KL pairs."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    from erniekit_lite.model.lora import apply_lora
    from erniekit_lite.recipe import LoraSection
    from erniekit_lite.train import scored
    from erniekit_lite.train.kto import rows_dataset
    from erniekit_lite.train.kto_loss import KTOLoss
    from erniekit_lite.train.reference import Reference
    from erniekit_lite.train.trainer import Trainer, ready

    torch.manual_seed(0)
    model = apply_lora(load_model(str(tiny_dense_dir), "float32", "packed_sdpa"), LoraSection(r=4, dropout=0.0))
    scored.take(model.get_base_model())  # as a run loads it (train/common.load_for_training)
    rows = pack_feedback(examples[2], 50)  # rows of two and rows of one
    assert len(rows) > 1

    def config(**kwargs):
        return KTOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, loss_type=loss_type, beta=0.1, max_length=None,
                         desirable_weight=weights[0], undesirable_weight=weights[1], remove_unused_columns=False, **kwargs)

    # the oracle: TRL's own trainer, with what it asks of the KL term (sequential order, more than one example per
    # batch); its reference: a frozen copy of the adapter as it starts (B = 0, i.e. the base)
    oracle = KTOTrainer(model=model, args=config(per_device_train_batch_size=2, train_sampling_strategy="sequential"),
                        train_dataset=Dataset.from_dict({"prompt": ["a", "b"], "completion": ["c", "d"], "label": [True, False]}),
                        processing_class=ernie_tokenizer)
    scored.without_trl_head(model.get_base_model())  # TRL's fused head put on in its __init__: back on only for its batch
    args = config(per_device_train_batch_size=1, train_sampling_strategy="random")  # any order, any batch size
    ours = Trainer(model=model, args=args, loss=KTOLoss(args, ready(model, args), Reference("adapters off")),
                   train_dataset=rows_dataset(rows), processing_class=ernie_tokenizer, data_collator=PackedFeedbackCollator(50))
    # no forward on the instance and no TRL class: the model's class scores (erniekit_lite/train/scored.py)
    assert "forward" not in vars(model.get_base_model()) and type(model.get_base_model()).__module__ == "erniekit_lite.train.scored"
    assert not any(c.__module__.startswith("trl") for c in type(ours).__mro__)
    move_off_the_reference(model)
    model.eval()
    padded = DataCollatorForUnpairedPreference(pad_token_id=0)(_trl_examples(rows))
    packed = PackedFeedbackCollator(50)([vars(r) for r in rows])
    if loss_type == "apo_zero_unpaired":
        packed = {k: v for k, v in packed.items() if not k.startswith("KL_")}
    trained = [p for p in model.parameters() if p.requires_grad]

    def loss_and_grads(trainer, batch):
        model.zero_grad()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        if trainer is oracle:
            metrics = {k: v[-1] for k, v in oracle._metrics["eval"].items()}
        else:
            metrics = ours.metrics.read("eval", ours.accelerator)
        return loss.item(), metrics, [p.grad.clone() for p in trained]

    with trls_own_head(model.get_base_model(), ("log_probs", "entropy", "mean_logits")):
        trl_loss, trl_metrics, trl_grads = loss_and_grads(oracle, padded)
    our_loss, our_metrics, our_grads = loss_and_grads(ours, packed)
    assert abs(trl_loss - our_loss) <= 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(trl_grads, our_grads)) <= 1e-5
    assert max(g.abs().max().item() for g in our_grads) > 1e-3  # the gradients compared are not all zero
    keys = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "logits/chosen",
            "logits/rejected", "entropy")
    for key in keys:
        assert abs(trl_metrics[key] - our_metrics[key]) <= 1e-4, key
    assert abs(our_metrics["rewards/margins"]) > 1e-3  # policy differs from the reference, so the check has teeth
    if loss_type == "kto":
        assert our_metrics["kl"] > 1e-3  # the KL term is in play (TRL clamps it at 0)


# --- the CLI --------------------------------------------------------------------------------------------------------


def kto_recipe(tmp_path: Path, model_dir, data=None, lora=True, **train) -> Path:
    train = {"beta": 0.1, "learning_rate": 5e-3, "max_steps": 30, "per_device_train_batch_size": 1, "activation_checkpointing": False,
             "logging_steps": 5, "save_steps": 30, "seed": 0, "lr_scheduler_type": "cosine", "undesirable_weight": 2.0, **train}
    return write_recipe(tmp_path / "kto.yaml", model_dir, method="kto", data={"train": [str(FEEDBACK)], **(data or {})},
                        train=train, lora={"r": 8, "alpha": 16, "dropout": 0.0} if lora else None)


def test_lora_kto_learns_the_labels(tmp_path, capsys, tiny_own_dir):
    """Criterion: evaluated on the training examples before and after 30 steps, the reward margin (mean reward of the
    desirable examples minus that of the undesirable ones; 0 at the start, when policy = reference) ends above 0.3 (0.71 here), and
    the desirable completions' mean log-prob rose relative to the undesirable ones' by the same margin / beta."""
    beta = 0.1
    recipe = kto_recipe(tmp_path, tiny_own_dir, data={"eval": [str(FEEDBACK)]}, eval_on_start=True, eval_strategy="steps", eval_steps=30)
    code, out, err = run_cli(capsys, "train", recipe)
    assert code == 0, err
    assert "26 examples (18 desirable, 8 undesirable) in" in out and "each with its KL twin" in out
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    evals = [h for h in history if "eval_loss" in h]
    before, after = evals[0], evals[-1]
    assert (before["step"], after["step"]) == (0, 30)
    assert abs(before["eval_rewards/margins"]) < 1e-4 and after["eval_rewards/margins"] > 0.3
    rise = (after["eval_logps/chosen"] - before["eval_logps/chosen"]) - (after["eval_logps/rejected"] - before["eval_logps/rejected"])
    assert rise == pytest.approx(after["eval_rewards/margins"] / beta, rel=1e-3)
    results = json.loads((tmp_path / "out" / "train_results.json").read_text())
    for key in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "train_tokens_per_second", "packing_efficiency"):
        assert key in results
    assert results["train_samples"] == 26 and 0.5 < results["packing_efficiency"] <= 1
    assert (tmp_path / "out" / "adapter_config.json").is_file() and not (tmp_path / "out" / "ref").exists()


@pytest.mark.parametrize("precompute", [False, True])
def test_full_kto_first_step_is_one_half_with_a_live_or_precomputed_reference(tmp_path, capsys, tiny_own_dir, precompute):
    """At step 1 the policy is the reference: every reward and the KL estimate are 0 and each example's loss is
    1 - sigmoid(0) = 0.5, only if the reference log-probs line up with the policy's example by example and twin by twin."""
    recipe = kto_recipe(tmp_path, tiny_own_dir, lora=False, max_steps=2, logging_steps=1, learning_rate=1e-5, undesirable_weight=1.0,
                        precompute_ref_log_probs=precompute, per_device_train_batch_size=2)
    code, out, err = run_cli(capsys, "train", recipe)
    assert code == 0, err
    assert (tmp_path / "out" / "model.safetensors").is_file()
    first = next(h for h in json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"] if "loss" in h)
    assert abs(first["loss"] - 0.5) < 1e-5 and abs(first["kl"]) < 1e-5 and abs(first["rewards/chosen"]) < 1e-5
    assert first["tokens_per_second"] > 0 and 0 < first["packing_efficiency"] <= 1


def _write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def test_validate_counts_labels_and_skips(tmp_path, capsys, tiny_own_dir):
    data = _write(tmp_path / "fb.jsonl", [
        {"prompt": "q", "completion": "yes", "label": True},
        {"prompt": "r", "completion": "no", "label": False},
        {"prompt": "s", "completion": "", "label": True},
        {"prompt": "word " * 200, "completion": "a", "label": False},
    ])
    code, out, err = run_cli(capsys, "validate", kto_recipe(tmp_path, tiny_own_dir, data={"train": [str(data)], "max_length": 64}))
    assert code == 0, err
    assert "feedback format auto-detected as 'trl'" in out and "4 records -> 3 examples" in out
    assert "2 examples (1 desirable, 1 undesirable) in 1 row, each with its KL twin" in out
    assert "skipped: 1 empty completion, 1 prompt longer than max_length" in out


def test_bad_feedback_is_a_one_line_error_before_the_run_dir(tmp_path, capsys, tiny_own_dir):
    bad = _write(tmp_path / "bad.jsonl", [{"src": ["q"], "tgt": ["a"], "label": True}, {"src": ["q"], "tgt": ["a"], "label": [0]}])
    code, _, err = run_cli(capsys, "train", kto_recipe(tmp_path, tiny_own_dir, data={"train": [str(bad)]}))
    assert code == 2 and f"{bad}:2: field 'label' is a list" in err and len(err.strip().splitlines()) == 1
    one = _write(tmp_path / "one.jsonl", [{"src": ["q"], "tgt": ["a"], "label": True}])
    code, _, err = run_cli(capsys, "train", kto_recipe(tmp_path, tiny_own_dir, data={"train": [str(one)]}))
    assert code == 2 and "at least 2 training examples are needed" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_card_of_a_kto_run(tmp_path):
    from huggingface_hub import ModelCard

    from erniekit_lite.hub import model_card
    from erniekit_lite.recipe import Recipe

    recipe = Recipe.model_validate({
        "model": {"path": "baidu/ERNIE-4.5-0.3B-PT"}, "method": "kto", "data": {"train": ["feedback.jsonl"], "max_length": 512},
        "output": {"dir": str(tmp_path)}, "train": {"learning_rate": 5e-7, "undesirable_weight": 1.5},
    })
    results = {"train_loss": 0.41, "train_tokens_per_second": 1234.4, "rewards/margins": 0.25, "kl": 0.125,
               "packing_efficiency": 0.9, "train_samples": 64, "epoch": 1.0}
    (tmp_path / "train_results.json").write_text(json.dumps(results))
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 8, "log_history": []}))
    card = ModelCard(model_card(tmp_path, recipe, "someone/ernie-kto"))
    assert "kto" in card.data.to_dict()["tags"]
    for row in ("| method | KTO (kto, beta 0.1, desirable / undesirable weights 1 / 1.5; KL term from mismatched completions "
                "within each packed row)", "| learning rate | 5e-07", "| max_length | 512 tokens per sequence",
                "| samples | 64 labelled completions", "| reward margin (last step) | 0.250", "| KL estimate (last step) | 0.125"):
        assert row in card.text, row
