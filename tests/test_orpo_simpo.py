"""ORPO and SimPO on the project's Trainer (train/reference_free.py: TRL's experimental ORPO and CPO losses ported)
on packed pair rows: per-sequence log-probs equal each sequence alone; loss, metrics and LoRA gradients equal TRL's own
ORPOTrainer / CPOTrainer on its padded batch; CLI runs learn the pairs."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from erniekit_lite.data.formats import Conversation, Turn
from erniekit_lite.data.pairs import PackedPairCollator, PaddedPairCollator, Pair, pack_pairs
from erniekit_lite.data.template import template_for
from erniekit_lite.data.tokenize import IGNORE, Tokenizer
from erniekit_lite.model.load import load_model
from helpers import move_off_the_reference, run_cli, write_recipe

ROOT = Path(__file__).resolve().parents[1]
PAIRS = ROOT / "recipes" / "data" / "identity_dpo.jsonl"
PROMPTS = [("Who are you?", "I am a tiny ERNIE model.", "No."), ("2+2?", "4", "Five, probably, or maybe six."), ("写诗", "春风拂面。", "不会。")]
COMPARED = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "nll_loss")


@pytest.fixture(scope="module")
def pairs(ernie_tokenizer):
    tok = Tokenizer(ernie_tokenizer, template_for(ernie_tokenizer))
    convs = [Conversation([Turn(q, a)], "Be brief.") for q, a, _ in PROMPTS] + [Conversation([Turn(q, r)], "Be brief.") for q, _, r in PROMPTS]
    samples, _ = tok(convs, 256)
    n = len(PROMPTS)
    return [Pair(samples[i], samples[n + i]) for i in range(n)]


def _dataset(rows):
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": [r.input_ids for r in rows], "labels": [r.labels for r in rows], "seq_lengths": [r.seq_lengths for r in rows]})


def _args(method: str, tmp_path, **config):
    from erniekit_lite.recipe import train_config_class

    return train_config_class(method)(output_dir=str(tmp_path), report_to="none", bf16=False, remove_unused_columns=False, **config)


def _trainer(method: str, model, tokenizer, rows, tmp_path, **config):
    from erniekit_lite.train.reference_free import pair_trainer

    return pair_trainer(method, model, _args(method, tmp_path, **config), train_dataset=_dataset(rows), processing_class=tokenizer,
                        data_collator=PackedPairCollator(256))


def _trl_trainer(method: str, model, tokenizer, tmp_path, **config):
    """TRL's own ORPOTrainer / CPOTrainer on the same model and arguments: the oracle. Its `__init__` tokenizes a
    dataset of text it is handed (never iterated here: the batch compared is `_trl_batch`)."""
    from datasets import Dataset
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    from trl.experimental.cpo import CPOConfig
    from trl.experimental.orpo import ORPOConfig

    text = Dataset.from_dict({"prompt": ["Hi?"], "chosen": ["Hello."], "rejected": ["No."]})
    # TRL's own config, with the values the project's arguments take for the method (trainer_args.py: simpo)
    args = (ORPOConfig if method == "orpo" else CPOConfig)(output_dir=str(tmp_path), report_to="none", bf16=False, max_length=256,
                                                           remove_unused_columns=False, **config)
    return (ORPOTrainer if method == "orpo" else CPOTrainer)(model=model, args=args, train_dataset=text, processing_class=tokenizer)


def _alone(model, sample) -> tuple[float, int, float]:
    """(summed log-prob of the trained tokens, their count, mean logit over their positions): the sequence alone."""
    ids = torch.tensor([sample.input_ids])
    labels = torch.tensor(sample.labels[1:])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    trained = labels != IGNORE
    logp = torch.log_softmax(logits, -1)[trained].gather(-1, labels[trained][:, None])
    return logp.sum().item(), int(trained.sum()), logits[trained].mean().item()


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_per_sequence_logps_equal_each_sequence_alone(tmp_path, tiny_dense_dir, ernie_tokenizer, pairs, packing):
    """ORPO's averages and CPO sigmoid's sums per sequence, from rows packed whole (one packed forward) or padded,
    equal each sequence scored alone (1e-5); the logits metric is the mean logit over the responses' positions; the
    NLL term is each chosen response's sum over its tokens, and the collator's chosen-token count (the Trainer's
    divisor) is their number."""
    model = load_model(str(tiny_dense_dir), "float32", "packed_sdpa").eval()
    rows = pack_pairs(pairs, 256, packing=packing)
    assert len(rows) == (1 if packing else len(pairs))
    collate = PackedPairCollator(256) if packing else PaddedPairCollator(0)
    batch = collate([vars(r) for r in rows])
    orpo = _trainer("orpo", model, ernie_tokenizer, rows, tmp_path / "orpo")
    cpo = _trainer("simpo", model, ernie_tokenizer, rows, tmp_path / "cpo", loss_type="sigmoid")
    assert (orpo.loss.average, cpo.loss.average) == (True, False)
    with torch.no_grad():
        means = orpo.loss.sequences(model, dict(batch))
        sums = cpo.loss.sequences(model, dict(batch))
    # the collators keep whole pairs in order, chosen rows first: find each packed pair by its chosen ids
    ids, starts = batch["input_ids"], batch["attention_mask"].sum(1)
    order = [next(p for p in pairs if p.chosen.input_ids == ids[k, : starts[k]].tolist()) for k in range(len(pairs))]
    assert sorted(map(id, order)) == sorted(map(id, pairs))
    positions = {"chosen": 0, "rejected": 0}
    logits_sum = {"chosen": 0.0, "rejected": 0.0}
    for k, pair in enumerate(order):
        for side, sample in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            total, n, mean_logit = _alone(model, sample)
            assert abs(getattr(sums, side)[k].item() - total) <= 1e-4
            assert abs(getattr(means, side)[k].item() - total / n) <= 1e-5
            if side == "chosen":  # the NLL term per pair, in row order: its chosen response's sum and token count
                assert abs(means.chosen_nll[k].item() + total) <= 1e-4 and means.chosen_tokens[k].item() == n
            positions[side] += n
            logits_sum[side] += mean_logit * n
    for side in ("chosen", "rejected"):  # (Σ mean logit over the side's scored positions, their count): TRL's metric
        value, count = means.logits[side]
        assert count.item() == positions[side]
        assert abs(value.item() / count.item() - logits_sum[side] / positions[side]) <= 1e-5
    # the NLL term: Σ -log p over every chosen response token of the batch, divided by the collator's count
    chosen_total = sum(_alone(model, p.chosen)[0] for p in pairs)
    assert batch["chosen_tokens"] == positions["chosen"] == orpo.loss.chosen_tokens(batch)
    nll = means.chosen_nll.sum().item() / batch["chosen_tokens"]  # the mean the step takes (one micro-batch)
    assert abs(nll + chosen_total / positions["chosen"]) <= 1e-5
    assert sums.chosen_nll.sum().item() / batch["chosen_tokens"] == pytest.approx(nll, abs=1e-6)  # CPO's cpo_alpha term: the same NLL
    assert orpo.loss.units(batch) == len(pairs)


def _trl_batch(pairs):
    """The pairs as TRL's ORPO / CPO tokenize them (`tokenize_row`), padded by TRL's own collator: prompt + response ids,
    labels -100 on the prompt. Our labels end a turn with `</s>` where the input has `<|end_of_sentence|>` (as ERNIEKit
    trains): TRL's labels are given as ours, so both score the same targets."""
    from trl.experimental.utils import DPODataCollatorWithPadding

    examples = []
    for pair in pairs:
        example = {}
        for name, sample in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            start = next(i for i, label in enumerate(sample.labels) if label != IGNORE)
            assert all(label != IGNORE for label in sample.labels[start:])  # one trained answer, at the end
            example["prompt_input_ids"] = sample.input_ids[:start]
            example["prompt_attention_mask"] = [1] * start
            example[f"{name}_input_ids"] = sample.input_ids
            example[f"{name}_attention_mask"] = [1] * len(sample)
            example[f"{name}_labels"] = sample.labels
        examples.append(example)
    return DPODataCollatorWithPadding(pad_token_id=0)(examples)


def _lora_model(tiny_dense_dir):
    from erniekit_lite.model.lora import apply_lora
    from erniekit_lite.recipe import LoraSection

    torch.manual_seed(0)
    model = apply_lora(load_model(str(tiny_dense_dir), "float32", "packed_sdpa"), LoraSection(r=4, dropout=0.0))
    move_off_the_reference(model)
    return model.eval()


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def _trl_loss_metrics_grads(trainer, model, batch):
    """TRL's own: its `get_batch_loss_metrics` (its `concatenated_forward`, loss and metrics) on its padded batch."""
    model.zero_grad()
    loss, metrics = trainer.get_batch_loss_metrics(model, batch, train_eval="train")
    loss.backward()
    return loss.item(), metrics, _grads(model)


def _our_loss_metrics_grads(trainer, model, batch):
    """Ours as a training step runs it: the step's pairs and chosen tokens counted (`get_batch_samples`), the
    micro-batch's loss (`compute_loss`: our `Loss` on the packed row), its backward, and the metrics as a logging
    step reads them from the device. The evaluation path (the micro-batch's own means) gives the same loss."""
    batch = trainer._prepare_inputs(batch)
    model.zero_grad()
    trainer.get_batch_samples(iter([batch]), 1, trainer.accelerator.device)
    assert (trainer.step_counts.units, trainer.step_counts.tokens) == (len(PROMPTS), batch["chosen_tokens"])
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    grads = _grads(model)
    metrics = trainer.metrics.read("train", trainer.accelerator)
    model.eval()
    with torch.no_grad():
        evaluated, parts = trainer.compute_loss(model, batch, return_outputs=True)
    model.train()
    assert trainer.metrics.read("eval", trainer.accelerator).keys() == metrics.keys()
    assert evaluated.item() == pytest.approx(loss.item(), abs=1e-6)
    # per pair in row order, so the evaluation loss can leave out the rows accelerate repeats (`Trainer._pool`)
    assert parts.total.shape == (len(PROMPTS),)
    if parts.tokens is not None:
        assert parts.tokens.shape == (len(PROMPTS),) and int(parts.chosen.sum()) == batch["chosen_tokens"]
    return loss.item(), metrics, grads


def _compare(trl, ours, keys):
    (trl_loss, trl_metrics, trl_grads), (our_loss, our_metrics, our_grads) = trl, ours
    assert set(our_metrics) == set(trl_metrics)  # every metric TRL logs, by its name, and no other
    assert abs(trl_loss - our_loss) <= 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(trl_grads, our_grads)) <= 1e-5
    assert max(g.abs().max().item() for g in our_grads) > 1e-3  # the gradients compared are not all zero
    for key in keys:
        assert abs(trl_metrics[key] - our_metrics[key]) <= 1e-5, key


def test_orpo_loss_packed_equals_trl_padded(tmp_path, tiny_dense_dir, ernie_tokenizer, pairs):
    """TRL's ORPOTrainer (its `get_batch_loss_metrics` and `odds_ratio_loss` on its own padded batch and
    `concatenated_forward`) and our Trainer with `ORPOLoss` on packed rows give the same loss, metrics and LoRA
    gradients, with one difference by design: TRL's ORPO takes the NLL over prompt + response (trl#1516); ours over the
    response, as TRL's CPO does. The TRL side takes its NLL so (the cross-entropy of its own logits against the chosen
    labels) for the comparison."""
    from trl.experimental.orpo import ORPOTrainer

    model = _lora_model(tiny_dense_dir)
    rows = pack_pairs(pairs, 256)
    trainer = _trainer("orpo", model, ernie_tokenizer, rows, tmp_path / "ours", beta=0.1)
    trl = _trl_trainer("orpo", model, ernie_tokenizer, tmp_path / "trl", beta=0.1)
    model.train()  # dropout is off (both trainers' disable_dropout)
    padded = _trl_batch(pairs)
    prompt_nll = []

    def trl_forward(self, model, batch):
        out = list(ORPOTrainer.concatenated_forward(self, model, batch))
        prompt_nll.append(out[4].item())
        width = out[2].shape[1] + 1  # TRL pads chosen and rejected to one width; its chosen logits are shifted
        labels = F.pad(batch["chosen_labels"], (0, width - batch["chosen_labels"].shape[1]), value=IGNORE)
        out[4] = F.cross_entropy(out[2].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE)
        return tuple(out)

    ours = _our_loss_metrics_grads(trainer, model, PackedPairCollator(256)([vars(r) for r in rows]))
    trl.concatenated_forward = types.MethodType(trl_forward, trl)
    theirs = _trl_loss_metrics_grads(trl, model, padded)
    _compare(theirs, ours, COMPARED + ("log_odds_ratio", "log_odds_chosen"))
    # the check has teeth: the values compared to 1e-5 are larger than that (the margin measured 8e-5 to over 1e-4, by run)
    assert abs(ours[1]["rewards/margins"]) > 2e-5 and abs(ours[1]["log_odds_chosen"]) > 1e-3
    assert abs(prompt_nll[0] - theirs[1]["nll_loss"]) > 1e-2  # TRL's own ORPO NLL (prompt included) is another number


@pytest.mark.parametrize(("loss_type", "cpo_alpha"), [("simpo", 0.0), ("simpo", 0.5), ("sigmoid", 1.0)],
                         ids=["simpo", "cpo-simpo", "cpo-sigmoid"])
def test_cpo_loss_packed_equals_trl_padded(tmp_path, tiny_dense_dir, ernie_tokenizer, pairs, loss_type, cpo_alpha):
    """TRL's CPOTrainer (SimPO: length-normalised log-probs, margin simpo_gamma; cpo_alpha x NLL of the chosen
    responses) on its own padded batch and forward, and our Trainer with `CPOLoss` on packed rows, give the same loss,
    metrics and LoRA gradients."""
    model = _lora_model(tiny_dense_dir)
    rows = pack_pairs(pairs, 256)
    config = {"loss_type": loss_type, "cpo_alpha": cpo_alpha, "beta": 2.0, "simpo_gamma": 1.0}
    trainer = _trainer("simpo", model, ernie_tokenizer, rows, tmp_path / "ours", **config)
    trl = _trl_trainer("simpo", model, ernie_tokenizer, tmp_path / "trl", **config)
    model.train()  # dropout is off (both trainers' disable_dropout)
    ours = _our_loss_metrics_grads(trainer, model, PackedPairCollator(256)([vars(r) for r in rows]))
    theirs = _trl_loss_metrics_grads(trl, model, _trl_batch(pairs))
    _compare(theirs, ours, COMPARED)
    assert abs(ours[1]["rewards/margins"]) > 1e-4
    assert (ours[1]["nll_loss"] > 0) == (cpo_alpha > 0)  # TRL logs 0 when cpo_alpha is 0


@pytest.fixture(scope="module")
def tiny_moe_ernie_dir(tmp_path_factory, ernie_tokenizer_dir) -> Path:
    """The tiny MoE with the real tokenizer (the pairs' ids)."""
    from erniekit_lite.tiny import write_tiny

    return Path(write_tiny(str(tmp_path_factory.mktemp("tiny-moe-ernie")), "moe", str(ernie_tokenizer_dir), hidden_size=64, layers=3))


def test_moe_aux_loss_equals_trl(tmp_path, tiny_moe_ernie_dir, ernie_tokenizer, pairs):
    """On the MoE (full fine-tuning, the router trained) the router aux loss is on with the config's coefficient, and
    TRL's CPOTrainer (CPO-SimPO), which adds coef x aux to its micro-batch's mean loss from the stock forward's padded
    rows, gives the loss, gradients and metrics ours gives with coef x aux on each pair from the packed row."""
    torch.manual_seed(0)
    model = load_model(str(tiny_moe_ernie_dir), "float32", "packed_sdpa")
    rows = pack_pairs(pairs, 256)
    config = {"cpo_alpha": 0.5, "beta": 2.0, "simpo_gamma": 1.0, "loss_type": "simpo"}
    trainer = _trainer("simpo", model, ernie_tokenizer, rows, tmp_path / "ours", **config)
    assert trainer.loss.aux.enabled and trainer.loss.aux.coef == 0.001
    trl = _trl_trainer("simpo", model, ernie_tokenizer, tmp_path / "trl", **config)
    assert trl.aux_loss_enabled and trl.aux_loss_coef == 0.001  # the config as `ready` wrote it: TRL's own rule reads it
    model.train()
    ours = _our_loss_metrics_grads(trainer, model, PackedPairCollator(256)([vars(r) for r in rows]))
    aux = []
    forward = type(trl).concatenated_forward

    def trl_forward(self, model, batch):  # TRL's own, its aux loss kept for the check below
        out = forward(self, model, batch)
        aux.append(out[5].item())
        return out

    trl.concatenated_forward = types.MethodType(trl_forward, trl)
    theirs = _trl_loss_metrics_grads(trl, model, _trl_batch(pairs))
    assert abs(ours[1].pop("aux_loss") - aux[0]) <= 1e-6 and aux[0] > 0.1  # TRL logs none: compared with its forward's
    _compare(theirs, ours, COMPARED)
    assert 0.001 * aux[0] > 1e-4  # the term is well above the loss's tolerance: dropped or doubled, the loss would differ


def _recipe(tmp_path: Path, model_dir, method: str, lora=True, data=None, **train) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    train = {"beta": 0.1, "learning_rate": 5e-3, "max_steps": 30, "per_device_train_batch_size": 2, "activation_checkpointing": False,
             "logging_steps": 5, "save_steps": 30, "seed": 0, "lr_scheduler_type": "cosine", "eval_on_start": True,
             "eval_strategy": "steps", "eval_steps": 30, **train}
    return write_recipe(tmp_path / f"{method}.yaml", model_dir, method=method, data={"train": [str(PAIRS)], "eval": [str(PAIRS)], **(data or {})},
                        train=train, lora={"r": 8, "alpha": 16, "dropout": 0.0} if lora else None)


def _evals(out: Path) -> tuple[dict, dict]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    evals = [h for h in history if "eval_loss" in h]
    return evals[0], evals[-1]


@pytest.mark.parametrize(("method", "train"), [("orpo", {"beta": 0.1}), ("simpo", {"beta": 2.0, "simpo_gamma": 1.0})])
def test_lora_run_learns_the_preferences(tmp_path, capsys, tiny_own_dir, method, train):
    code, out, err = run_cli(capsys, "train", _recipe(tmp_path, tiny_own_dir, method, **train))
    assert code == 0, err
    run = tmp_path / "out"
    results = json.loads((run / "train_results.json").read_text())
    # eval set = the training pairs: the tuned policy prefers the chosen answers, by a wider margin than at the start
    before, after = _evals(run)
    assert (before["step"], after["step"]) == (0, 30)
    assert results["eval_rewards/accuracies"] > 0.9
    assert after["eval_rewards/margins"] > before["eval_rewards/margins"] + 0.05
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "train_tokens_per_second", "packing_efficiency"):
        assert key in results
    assert "reward accuracy" in out
    assert (run / "adapter_config.json").is_file() and not (run / "ref").exists()
    card = (run / "README.md").read_text()
    assert {"orpo": "ORPO (no reference model; odds-ratio weight beta 0.1", "simpo": "SimPO (no reference model; beta 2"}[method] in card
    assert "preference pairs" in card


def test_full_simpo_and_moe_orpo_train(tmp_path, capsys, tiny_own_dir, tiny_moe_dir):
    """Full fine-tuning trains the LM head through the same scores; on the MoE the router aux loss is on (the model
    config's coefficient, as in SFT and DPO) and the expert load is recorded."""
    code, out, err = run_cli(capsys, "train", _recipe(tmp_path / "full", tiny_own_dir, "simpo", lora=False, max_steps=3, logging_steps=1,
                                                      learning_rate=1e-4, eval_strategy="no", eval_on_start=False, save_steps=3))
    assert code == 0, err
    assert (tmp_path / "full" / "out" / "model.safetensors").is_file()
    code, out, err = run_cli(capsys, "train", _recipe(tmp_path / "moe", tiny_moe_dir, "orpo", max_steps=2, logging_steps=1,
                                                      eval_strategy="no", eval_on_start=False, save_steps=2))
    assert code == 0, err
    assert "router aux loss coefficient 0.001, logged as aux_loss" in out
    history = json.loads((tmp_path / "moe" / "out" / "trainer_state.json").read_text())["log_history"]
    assert all(h["aux_loss"] > 0 for h in history if "loss" in h)
    assert (tmp_path / "moe" / "out" / "expert_load.json").is_file()


def test_validate_and_simpo_loss_type(tmp_path, capsys, tiny_own_dir):
    code, out, err = run_cli(capsys, "validate", _recipe(tmp_path, tiny_own_dir, "orpo"))
    assert code == 0, err
    assert "8 pairs in 2 rows" in out and "512 tokens per micro-batch" in out  # 2 rows of whole pairs, 2 x max_length each
    code, out, err = run_cli(capsys, "validate", _recipe(tmp_path, tiny_own_dir, "simpo", loss_type="sigmoid"))
    assert code == 2 and "train.loss_type: method simpo is CPO's loss_type simpo" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli(capsys, "validate", _recipe(tmp_path, tiny_own_dir, "orpo", simpo_gamma=1.0))
    assert code == 2 and "unknown key 'simpo_gamma' in train" in err  # ORPOConfig's fields only


def test_what_method_simpo_makes_of_the_cpo_arguments(tmp_path):
    """`method: simpo` is CPO's loss_type simpo with no NLL term; `cpo_alpha` > 0 makes it CPO-SimPO."""
    from erniekit_lite.recipe import from_dict
    from erniekit_lite.trainer_args import training_args

    raw = {"model": {"path": "m"}, "method": "simpo", "data": {"train": ["x.jsonl"]}, "output": {"dir": str(tmp_path / "o")}}
    args = training_args(from_dict(raw), tmp_path / "o")
    assert (args.loss_type, args.cpo_alpha, args.simpo_gamma, args.beta) == ("simpo", 0.0, 0.5, 0.1)
    assert training_args(from_dict({**raw, "train": {"cpo_alpha": 0.5}}), tmp_path / "o").cpo_alpha == 0.5  # CPO-SimPO


@pytest.mark.parametrize("method", ["orpo", "simpo"])
def test_lora_plus_groups(tmp_path, tiny_dense_dir, ernie_tokenizer, pairs, method):
    """lora.plus_lr_ratio (LoRA+, train/optimizer.py) reaches these trainers as SFT's: B matrices at lr x ratio. The
    ratio is set on the trainer as train/run.py sets it from the plan (the CLI path: tests/test_lora_variants.py)."""
    from erniekit_lite.model.lora import apply_lora
    from erniekit_lite.recipe import LoraSection

    model = apply_lora(load_model(str(tiny_dense_dir), "float32", "packed_sdpa"), LoraSection(r=4, dropout=0.0, plus_lr_ratio=4))
    trainer = _trainer(method, model, ernie_tokenizer, pack_pairs(pairs, 256), tmp_path, learning_rate=1e-4)
    assert trainer.create_optimizer().param_groups[0]["lr"] == 1e-4 and len({g["lr"] for g in trainer.optimizer.param_groups}) == 1
    trainer.optimizer, trainer.lora_plus_ratio = None, 4
    lrs = {group["lr"] for group in trainer.create_optimizer().param_groups if group["params"]}
    assert lrs == {1e-4, 4e-4}


@pytest.mark.parametrize("lora", [True, False])
def test_validate_plans_what_dropping_the_reference_saves(tmp_path, tiny_own_dir, lora):
    """validate on ORPO/SimPO prints DPO's plan for the same rows: exactly what `validate` gives the DPO recipe, and
    with full fine-tuning more by the frozen reference copy DPO holds."""
    from erniekit_lite import recipe as recipes
    from erniekit_lite.plan import plan

    lines: list[str] = []
    orpo = plan(recipes.load(_recipe(tmp_path / "orpo", tiny_own_dir, "orpo", lora=lora)), log=lines.append)
    dpo = plan(recipes.load(_recipe(tmp_path / "dpo", tiny_own_dir, "dpo", lora=lora)), log=lambda *a: None)
    assert orpo["memory_gb_as_dpo"] == dpo["memory_gb"]
    said = next(line for line in lines if "vs DPO on the same rows" in line)
    assert f"DPO would plan {dpo['memory_gb']:.1f} GiB" in said and "no-grad forward of every row" in said
    more = int(said.split("GiB, ")[1].split(" MiB more")[0].replace(",", ""))
    if lora:
        # no copy: the no-grad reference pass holds no activations for backward and peaks below the training step
        assert "adapter disabled" in said and more == 0 and dpo["memory_gb"] == orpo["memory_gb"]
    else:  # the tiny model's fp32 copy: a few MiB
        assert "frozen copy of the model" in said and more > 0
