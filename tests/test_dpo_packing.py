"""Packed preference rows are exact: per-sample log-probs and TRL's DPO loss equal the padded computation."""

from __future__ import annotations

import pytest
import torch

from erniekit_lite.data.formats import Conversation, Turn
from erniekit_lite.data.pairs import PackedPairCollator, Pair, pack_pairs
from erniekit_lite.data.template import template_for
from erniekit_lite.data.tokenize import IGNORE, Sample, Tokenizer
from erniekit_lite.model.load import load_model
from helpers import move_off_the_reference, trls_own_head

PROMPTS = [("Who are you?", "I am a tiny ERNIE model.", "No."), ("2+2?", "4", "Five, probably, or maybe six."), ("写诗", "春风拂面。", "不会。")]


@pytest.fixture(scope="module")
def pairs(ernie_tokenizer):
    tok = Tokenizer(ernie_tokenizer, template_for(ernie_tokenizer))
    convs = [Conversation([Turn(q, a)], "Be brief.") for q, a, _ in PROMPTS] + [Conversation([Turn(q, r)], "Be brief.") for q, _, r in PROMPTS]
    samples, _ = tok(convs, 256)
    n = len(PROMPTS)
    return [Pair(samples[i], samples[n + i]) for i in range(n)]


def _logp_alone(model, sample: Sample) -> float:
    ids = torch.tensor([sample.input_ids])
    labels = torch.tensor(sample.labels[1:])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
    logp = torch.log_softmax(logits.float(), -1)
    trained = labels != IGNORE
    return logp[trained].gather(-1, labels[trained][:, None]).sum().item()


def _trl_patched(model):
    from trl.trainer.utils import add_fused_lm_head

    from erniekit_lite.train import scored

    # as the DPO trainer leaves it: TRL's fused head put on in its `__init__`, then taken off for our class's forward
    scored.take(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    scored.without_trl_head(model)
    return model


def test_packed_pair_logps_equal_each_sample_alone(tiny_dense_dir, pairs):
    model = _trl_patched(load_model(str(tiny_dense_dir), "float32", "packed_sdpa").eval())
    rows = pack_pairs(pairs, 256)
    assert len(rows) == 1
    batch = PackedPairCollator(256)([vars(r) for r in rows])
    with torch.no_grad():
        out = model(**{k: v for k, v in batch.items() if k not in ("completion_mask", "token_slots")}, fused_lm_head=True)
    per_row = out.log_probs.sum(1)
    b = len(pairs)
    # Rows are packed best-fit-decreasing: find each packed pair's source by content. Each pair sits whole,
    # chosen then rejected, at the row's sample bounds
    ids = batch["packed_input_ids"][0].tolist()
    starts = batch["cu_seq_lens_q"].tolist()
    packed_pairs = [next(p for p in pairs if p.chosen.input_ids == ids[starts[2 * k] : starts[2 * k + 1]]) for k in range(b)]
    assert sorted(map(id, packed_pairs)) == sorted(map(id, pairs))  # every pair once
    for k, pair in enumerate(packed_pairs):
        assert ids[starts[2 * k + 1] : starts[2 * k + 2]] == pair.rejected.input_ids
    assert rows[0].seq_lengths == [len(s) for p in packed_pairs for s in (p.chosen, p.rejected)]
    for k, pair in enumerate(packed_pairs):
        assert abs(per_row[k].item() - _logp_alone(model, pair.chosen)) <= 1e-4
        assert abs(per_row[b + k].item() - _logp_alone(model, pair.rejected)) <= 1e-4
    # completion mask in the padded layout covers exactly the trained tokens
    assert int(batch["completion_mask"].sum()) == sum(sum(l != IGNORE for l in s.labels) for p in pairs for s in (p.chosen, p.rejected))


def _trl_examples(pairs):
    """The production pairs as TRL's padded collator takes them: prompt ids, then each completion as its labels.

    Our samples end a turn with the input `<|end_of_sentence|>` labelled `</s>` (as ERNIEKit trains); TRL scores a
    completion's own ids. Ending TRL's completion with `</s>` makes it score the same targets: the last token's
    input is never read by an earlier position (causal attention) and predicts nothing in the loss."""
    examples = []
    for pair in pairs:
        example = {}
        for name, sample in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            start = next(i for i, label in enumerate(sample.labels) if label != IGNORE)
            assert all(label != IGNORE for label in sample.labels[start:])  # one trained answer, at the end
            example["prompt_ids"] = sample.input_ids[:start]
            example[f"{name}_ids"] = sample.labels[start:]
        examples.append(example)
    return examples


@pytest.mark.parametrize("loss_type", [["sigmoid"], ["ipo"], ["hinge"], ["sigmoid", "sft"]], ids=["sigmoid", "ipo", "hinge", "rpo"])
def test_dpo_loss_packed_equals_trl_padded(tmp_path, tiny_dense_dir, ernie_tokenizer, pairs, loss_type):
    """Loss, metrics and LoRA gradients of TRL's own DPOTrainer (the oracle: its padded batch and forward) equal the
    project's DPO loss (train/dpo_loss.py) on packed rows, for the pairs as training makes them (end of turn
    labelled `</s>`)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from erniekit_lite.model.lora import apply_lora
    from erniekit_lite.recipe import LoraSection
    from erniekit_lite.train import scored
    from erniekit_lite.train.dpo_loss import DPOLoss
    from erniekit_lite.train.reference import Reference
    from erniekit_lite.train.trainer import Trainer, ready

    torch.manual_seed(0)
    model = apply_lora(load_model(str(tiny_dense_dir), "float32", "packed_sdpa"), LoraSection(r=4, dropout=0.0))
    scored.take(model.get_base_model())  # as a run loads it (train/common.load_for_training)
    examples = _trl_examples(pairs)
    assert examples[0]["chosen_ids"][-1] == ernie_tokenizer.convert_tokens_to_ids("</s>")
    rows = pack_pairs(pairs, 256)
    dataset = Dataset.from_dict({"input_ids": [r.input_ids for r in rows], "labels": [r.labels for r in rows], "seq_lengths": [r.seq_lengths for r in rows]})
    args = DPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, loss_type=loss_type, beta=0.1, max_length=None,
                     remove_unused_columns=False)
    # the oracle: TRL's own trainer (its reference: a frozen copy of the adapter as it starts, B = 0, i.e. the base)
    oracle = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]}),
                        processing_class=ernie_tokenizer)
    scored.without_trl_head(model.get_base_model())  # TRL's fused head put on in its __init__: back on only for its batch
    ours = Trainer(model=model, args=args, loss=DPOLoss(args, ready(model, args), Reference("adapters off")),
                   train_dataset=dataset, processing_class=ernie_tokenizer, data_collator=PackedPairCollator(256))
    # no forward on the instance and no TRL class: the model's class scores (erniekit_lite/train/scored.py)
    assert "forward" not in vars(model.get_base_model()) and type(model.get_base_model()).__module__ == "erniekit_lite.train.scored"
    assert not any(c.__module__.startswith("trl") for c in type(ours).__mro__)
    move_off_the_reference(model)
    model.eval()
    padded = DataCollatorForPreference(pad_token_id=0)(examples)  # TRL's own padded batch, in TRL's own forward
    packed = PackedPairCollator(256)([vars(r) for r in rows])
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

    with trls_own_head(model.get_base_model(), ("log_probs", "entropy", "mean_logits", "is_top1")):
        trl_loss, trl_metrics, trl_grads = loss_and_grads(oracle, padded)
    our_loss, our_metrics, our_grads = loss_and_grads(ours, packed)
    assert abs(trl_loss - our_loss) <= 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(trl_grads, our_grads)) <= 1e-5
    assert max(g.abs().max().item() for g in our_grads) > 1e-3  # the gradients compared are not all zero
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected",
                "mean_token_accuracy", "entropy", "logits/chosen", "logits/rejected"):
        assert abs(trl_metrics[key] - our_metrics[key]) <= 1e-4, key
    assert abs(our_metrics["rewards/margins"]) > 1e-4  # policy differs from the reference, so the check has teeth


def test_padded_pair_collator_scores_match_packed(tiny_dense_dir, pairs):
    from erniekit_lite.data.pairs import PaddedPairCollator

    model = _trl_patched(load_model(str(tiny_dense_dir), "float32", "packed_sdpa").eval())
    rows = pack_pairs(pairs, 256, packing=False)
    assert len(rows) == len(pairs)
    with torch.no_grad():
        packed = PackedPairCollator(256)([vars(r) for r in rows])
        padded = PaddedPairCollator(0)([vars(r) for r in rows])
        a = model(**{k: v for k, v in packed.items() if k not in ("completion_mask", "token_slots")}, fused_lm_head=True).log_probs.sum(1)
        b = model(**{k: v for k, v in padded.items() if k not in ("completion_mask", "token_slots")}, fused_lm_head=True).log_probs.sum(1)
    assert torch.allclose(a, b, atol=1e-4)
    assert torch.equal(packed["completion_mask"], padded["completion_mask"])


def test_every_dpo_loss_type_and_option_equals_trl(tmp_path, tiny_dense_dir, ernie_tokenizer, pairs):
    """Each of TRL 1.16's 15 DPO loss types, the f-divergences, LD-DPO's `ld_alpha`, WPO's weighting and a weighted
    mixture: the project's loss and gradients equal TRL's own DPOTrainer (the oracle) on the same pairs (TRL's padded
    batch in its forward, ours packed), within 1e-5 relative to the largest. One pair of trainers, reconfigured per
    case."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from erniekit_lite.model.lora import apply_lora
    from erniekit_lite.recipe import LoraSection
    from erniekit_lite.train import scored
    from erniekit_lite.train.dpo_loss import LOSS_TYPES, DPOLoss
    from erniekit_lite.train.reference import Reference
    from erniekit_lite.train.trainer import Trainer, ready

    torch.manual_seed(0)
    model = apply_lora(load_model(str(tiny_dense_dir), "float32", "packed_sdpa"), LoraSection(r=4, dropout=0.0))
    scored.take(model.get_base_model())
    rows = pack_pairs(pairs, 256)
    args = DPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, beta=0.1, max_length=None, remove_unused_columns=False)
    oracle = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]}),
                        processing_class=ernie_tokenizer)
    scored.without_trl_head(model.get_base_model())
    loss = DPOLoss(args, ready(model, args), Reference("adapters off"))
    ours = Trainer(model=model, args=args, loss=loss, train_dataset=Dataset.from_dict({"input_ids": [r.input_ids for r in rows]}),
                   processing_class=ernie_tokenizer, data_collator=PackedPairCollator(256))
    move_off_the_reference(model)
    model.eval()
    padded = DataCollatorForPreference(pad_token_id=0)(_trl_examples(pairs))
    packed = PackedPairCollator(256)([vars(r) for r in rows])
    trained = [p for p in model.parameters() if p.requires_grad]
    cases = [{"loss_type": [t]} for t in LOSS_TYPES]
    cases[[c["loss_type"][0] for c in cases].index("robust")]["label_smoothing"] = 0.1
    cases[[c["loss_type"][0] for c in cases].index("exo_pair")]["label_smoothing"] = 1e-3
    cases += [{"loss_type": ["sigmoid"], "f_divergence_type": f, "f_alpha_divergence_coef": 0.3}
              for f in ("forward_kl", "js_divergence", "alpha_divergence")]
    cases += [{"loss_type": ["sigmoid"], "ld_alpha": 0.5}, {"loss_type": ["ipo"], "use_weighting": True},
              {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]}]

    def run(trainer, batch):
        model.zero_grad()
        value = trainer.compute_loss(model, batch)
        value.backward()
        return value.item(), [p.grad.clone() for p in trained]

    for case in cases:
        settings = {"loss_type": case["loss_type"], "loss_weights": case.get("loss_weights", [1.0] * len(case["loss_type"])),
                    "label_smoothing": case.get("label_smoothing", 0.0), "f_divergence_type": case.get("f_divergence_type", "reverse_kl"),
                    "f_alpha_divergence_coef": case.get("f_alpha_divergence_coef", 0.5), "ld_alpha": case.get("ld_alpha"),
                    "use_weighting": case.get("use_weighting", False)}
        oracle.loss_types, oracle.loss_weights = settings["loss_type"], settings["loss_weights"]
        oracle.label_smoothing, oracle.f_divergence_type = settings["label_smoothing"], settings["f_divergence_type"]
        oracle.f_alpha_divergence_coef, oracle.ld_alpha = settings["f_alpha_divergence_coef"], settings["ld_alpha"]
        oracle.use_weighting = settings["use_weighting"]
        loss.loss_types, loss.loss_weights = settings["loss_type"], settings["loss_weights"]
        loss.label_smoothing, loss.f_divergence = settings["label_smoothing"], settings["f_divergence_type"]
        loss.f_alpha, loss.ld_alpha, loss.use_weighting = settings["f_alpha_divergence_coef"], settings["ld_alpha"], settings["use_weighting"]
        with trls_own_head(model.get_base_model(), ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")):
            expected, expected_grads = run(oracle, padded)
        got, grads = run(ours, packed)
        assert abs(expected - got) <= 1e-5 * max(1.0, abs(expected)), case
        largest = max(g.abs().max().item() for g in expected_grads)
        assert max((a - b).abs().max().item() for a, b in zip(expected_grads, grads)) <= 1e-5 * max(1.0, largest), case
        assert max(g.abs().max().item() for g in grads) > 1e-4, case  # a gradient with teeth
