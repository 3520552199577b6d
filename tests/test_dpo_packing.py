"""Packed preference rows are exact: per-sample log-probs and TRL's DPO loss equal the padded computation."""

from __future__ import annotations

import pytest
import torch

from erniekit_lite.data.formats import Conversation, Turn
from erniekit_lite.data.pairs import PackedPairCollator, Pair, pack_pairs
from erniekit_lite.data.template import template_for
from erniekit_lite.data.tokenize import IGNORE, Sample, Tokenizer
from erniekit_lite.model.load import load_model

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

    from erniekit_lite.train.dpo_trainer import add_packed_forward

    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    add_packed_forward(model)
    return model


def test_packed_pair_logps_equal_each_sample_alone(tiny_dense_dir, pairs):
    model = _trl_patched(load_model(str(tiny_dense_dir), "float32", "packed_sdpa").eval())
    rows = pack_pairs(pairs, 256)
    assert len(rows) == 1 and rows[0].seq_lengths == [len(s) for p in pairs for s in (p.chosen, p.rejected)] or len(rows) == 1
    batch = PackedPairCollator(256)([vars(r) for r in rows])
    order = [i for r in rows for i in range(len(r.seq_lengths) // 2)]
    with torch.no_grad():
        out = model(**{k: v for k, v in batch.items() if k not in ("completion_mask", "token_slots")}, fused_lm_head=True)
    per_row = out.log_probs.sum(1)
    b = len(pairs)
    # rows were packed best-fit-decreasing: map each packed pair back to its source pair by content
    packed_pairs = []
    ids = batch["packed_input_ids"][0].tolist()
    starts = batch["cu_seq_lens_q"].tolist()
    for k in range(b):
        chosen = ids[starts[2 * k] : starts[2 * k + 1]]
        packed_pairs.append(next(p for p in pairs if p.chosen.input_ids == chosen))
    assert len(order) == b
    for k, pair in enumerate(packed_pairs):
        assert abs(per_row[k].item() - _logp_alone(model, pair.chosen)) <= 1e-4
        assert abs(per_row[b + k].item() - _logp_alone(model, pair.rejected)) <= 1e-4
    # completion mask in the padded layout covers exactly the trained tokens
    assert int(batch["completion_mask"].sum()) == sum(sum(l != IGNORE for l in s.labels) for p in pairs for s in (p.chosen, p.rejected))


def _raw_pairs(tokenizer):
    """Pairs whose trained tokens are labelled with their own ids, as TRL labels them."""
    bos, eot = tokenizer.convert_tokens_to_ids(["<|begin_of_sentence|>", "<|end_of_sentence|>"])
    examples, pairs = [], []
    for q, a, r in PROMPTS:
        prompt = [bos] + tokenizer.encode(f"User: {q}\nAssistant: ", add_special_tokens=False)
        chosen = tokenizer.encode(a, add_special_tokens=False) + [eot]
        rejected = tokenizer.encode(r, add_special_tokens=False) + [eot]
        examples.append({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected})
        pairs.append(Pair(Sample(prompt + chosen, [IGNORE] * len(prompt) + chosen), Sample(prompt + rejected, [IGNORE] * len(prompt) + rejected)))
    return examples, pairs


@pytest.mark.parametrize("loss_type", [["sigmoid"], ["ipo"], ["hinge"], ["sigmoid", "sft"]], ids=["sigmoid", "ipo", "hinge", "rpo"])
def test_dpo_loss_packed_equals_trl_padded(tmp_path, tiny_dense_dir, ernie_tokenizer, loss_type):
    from datasets import Dataset
    from trl import DPOConfig
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from erniekit_lite.model.lora import apply_lora
    from erniekit_lite.recipe import LoraSection
    from erniekit_lite.train.dpo_trainer import ErnieDPOTrainer

    torch.manual_seed(0)
    model = apply_lora(load_model(str(tiny_dense_dir), "float32", "packed_sdpa"), LoraSection(r=4, dropout=0.0))
    examples, pairs = _raw_pairs(ernie_tokenizer)
    rows = pack_pairs(pairs, 256)
    dataset = Dataset.from_dict({"input_ids": [r.input_ids for r in rows], "labels": [r.labels for r in rows], "seq_lengths": [r.seq_lengths for r in rows]})
    args = DPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, loss_type=loss_type, beta=0.1, max_length=None)
    trainer = ErnieDPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=ernie_tokenizer, data_collator=PackedPairCollator(256))
    with torch.no_grad():  # move the policy away from the reference (the trained LoRA B starts at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name and p.requires_grad:
                p.normal_(0, 0.05)
    model.eval()
    padded = DataCollatorForPreference(pad_token_id=0)(examples)  # TRL's own padded batch, in TRL's own forward
    packed = PackedPairCollator(256)([vars(r) for r in rows])
    with torch.no_grad():
        trl_loss = trainer.compute_loss(model, padded)
        trl_metrics = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
        trainer._metrics["eval"].clear()
        our_loss = trainer.compute_loss(model, packed)
        our_metrics = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    assert abs(trl_loss.item() - our_loss.item()) <= 1e-5
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected", "mean_token_accuracy"):
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
