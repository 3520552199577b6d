"""`method: rm`: reward models on the project's Trainer (train/rm.py's loss) over packed preference pairs.

Packed rewards equal each sequence run alone; the loss, metrics and gradients equal TRL's own RewardTrainer (the oracle)
on its own padded batches; a short CLI run learns the identity pairs; the saved run reloads (erniekit-lite, transformers' Auto
class in a fresh process, merged) with the trained rewards; `score()` renders items as training did.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import TEST_EXTRA, need_module
import torch

from erniekit_lite import recipe as recipes
from erniekit_lite.data.pairs import PackedPairCollator, PaddedPairCollator
from erniekit_lite.data.prepare import prepare_pairs
from erniekit_lite.errors import UserError
from erniekit_lite.model import reward
from erniekit_lite.model.lora import unwrap
from tests.helpers import PAIRS, run_cli, write_recipe

TOL = 1e-5  # fp32


def _recipe(model_dir: Path, tmp: Path, lora: dict | None = None, **changes):
    path = write_recipe(tmp / "rm.yaml", model_dir, method="rm", data={"train": [str(PAIRS)]}, lora=lora, out=tmp / "run", **changes)
    return recipes.load(path)


def _items() -> list[tuple[str, str]]:
    """The identity pairs as (prompt, completion) items: chosen, rejected, chosen, rejected, ..."""
    items = []
    for line in PAIRS.read_text().splitlines():
        record = json.loads(line)
        answers = {rank: text[0] for rank, text in zip(record["sort"], record["response"])}
        items += [(record["src"][0], answers[1]), (record["src"][0], answers[0])]
    return items


def _alone(model, ids: list[int]) -> float:
    """transformers' own forward on one unpadded sequence (the reward at its last token)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


def _sequences(batch: dict) -> list[list[int]]:
    """The [2B, L] padded layout's sequences, chosen rows first."""
    return [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]


def test_the_transformers_facts_the_reward_classes_rest_on():
    from transformers import Ernie4_5_MoeConfig, Ernie4_5Config
    from transformers.models.auto.auto_factory import _LazyAutoMapping
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as NAMES

    assert "ernie4_5" not in NAMES and "ernie4_5_moe" not in NAMES  # transformers has no class of its own
    mapping = _LazyAutoMapping(CONFIG_MAPPING_NAMES, NAMES)
    mapping.register(Ernie4_5Config, reward.Ernie4_5ForSequenceClassification)
    assert Ernie4_5Config not in mapping  # a config of transformers' own: skipped silently without exist_ok
    mapping.register(Ernie4_5Config, reward.Ernie4_5ForSequenceClassification, exist_ok=True)
    assert mapping[Ernie4_5Config] is reward.Ernie4_5ForSequenceClassification
    from transformers import AutoModelForSequenceClassification

    for config, cls in reward.CLASSES.items():  # registered by importing erniekit_lite.model.reward
        assert AutoModelForSequenceClassification._model_mapping[config] is cls
    assert reward.CLASSES[Ernie4_5_MoeConfig].base_model_prefix == "model"


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_a_causal_checkpoint_loads_with_its_weights_and_a_new_head(arch, tiny_dense_dir, tiny_moe_dir):
    from transformers import set_seed

    from erniekit_lite.model.load import load_model

    model_dir = str(tiny_dense_dir if arch == "dense" else tiny_moe_dir)
    causal = load_model(model_dir).state_dict()
    set_seed(0)
    model = reward.load_model(model_dir)
    weights = model.state_dict()
    assert set(weights) - set(causal) == {"score.weight"} and set(causal) - set(weights) == {"lm_head.weight"}
    assert all(torch.equal(weights[k], causal[k]) for k in weights if k != "score.weight")  # every base weight kept
    head = model.score.weight
    assert head.shape == (1, model.config.hidden_size) and model.score.bias is None and model.config.num_labels == 1
    # transformers' init of a new Linear: normal(0, initializer_range), drawn after the seed
    assert abs(head.std().item() - model.config.initializer_range) < 0.3 * model.config.initializer_range
    set_seed(0)
    assert torch.equal(reward.load_model(model_dir).score.weight, head)


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_packed_rewards_equal_each_sequence_alone(arch, tiny_dense_dir, tiny_moe_dir, tmp_path, one_thread):
    model_dir = tiny_dense_dir if arch == "dense" else tiny_moe_dir
    r = _recipe(model_dir, tmp_path)
    from erniekit_lite.model.load import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    data = prepare_pairs(r.data, tokenizer, log=lambda *a: None)
    torch.manual_seed(0)
    model = reward.load_model(str(model_dir), "float32", "packed_sdpa").eval()
    model.score.weight.data.normal_(0, 1)  # rewards of order 1..10, so a wrong position shows
    model.config.pad_token_id = tokenizer.pad_token_id
    rows = [vars(row) for row in data.train.rows]
    assert len(rows) > 1 and all(len(row["seq_lengths"]) > 2 for row in rows)  # several rows of several pairs
    packed = PackedPairCollator(r.data.max_length)(rows)
    with torch.no_grad():
        rewards = model(**packed, use_cache=False).logits[:, 0]
    sequences = _sequences(packed)
    assert len(rewards) == len(sequences) == 2 * len(data.train.pairs)
    # the chosen rows hold the pairs' chosen sides, the rejected rows the same pairs' rejected sides
    chosen = {tuple(p.chosen.input_ids): tuple(p.rejected.input_ids) for p in data.train.pairs}
    b = len(sequences) // 2
    assert all(chosen[tuple(sequences[k])] == tuple(sequences[b + k]) for k in range(b))
    alone = torch.tensor([_alone(model, ids) for ids in sequences])
    assert (rewards - alone).abs().max().item() <= TOL
    assert alone.std() > 0.5  # distinct rewards: a mixed-up order would not pass
    # every sequence ends with its end-of-turn token, where the reward is read
    eot = tokenizer.convert_tokens_to_ids("<|end_of_sentence|>")
    assert all(ids[-1] == eot for ids in sequences)

    model.set_attn_implementation("sdpa")  # padded rows need a mask-reading attention
    padded = PaddedPairCollator(tokenizer.pad_token_id)(rows)
    with torch.no_grad():
        assert (model(**padded).logits[:, 0] - alone).abs().max().item() <= TOL


@pytest.mark.parametrize("arch,lora,margin", [("dense", None, False), ("moe", {"r": 4, "alpha": 8}, True)],
                         ids=["dense-full", "moe-lora-margin"])
def test_loss_metrics_and_gradients_equal_trls_own_reward_trainer(arch, lora, margin, tiny_dense_dir, tiny_moe_dir, tmp_path, one_thread):
    """Our Trainer and loss (packed rows, our forward) against TRL's RewardTrainer with its own collator and transformers'
    stock forward, on the same pairs and weights: loss (with center_rewards_coefficient, and a batch's `margin` per
    pair), every metric, every gradient."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    from erniekit_lite import run_plan
    from erniekit_lite.model.load import load_tokenizer
    from erniekit_lite.train import rm
    from erniekit_lite.train.common import load_for_training
    from erniekit_lite.trainer_args import training_args

    model_dir = tiny_dense_dir if arch == "dense" else tiny_moe_dir
    r = _recipe(model_dir, tmp_path, lora=lora, train={"center_rewards_coefficient": 0.01, "seed": 0, "bf16": False})
    tokenizer = load_tokenizer(str(model_dir))
    data = prepare_pairs(r.data, tokenizer, log=lambda *a: None)
    args = training_args(r, tmp_path / "ours")
    plan = run_plan.resolve(r, args, 10**12, log=lambda *a: None)
    ours_model = load_for_training(plan, log=lambda *a: None)
    theirs_model = copy.deepcopy(ours_model)
    unwrap(theirs_model).set_attn_implementation("sdpa")
    ours = rm.build_trainer(ours_model, tokenizer, args, data, plan)

    pairs = data.train.pairs
    margins = [0.5 * (i % 3) for i in range(len(pairs))]  # distinct per pair: a pair given another's would show
    columns = {"chosen_ids": [p.chosen.input_ids for p in pairs], "rejected_ids": [p.rejected.input_ids for p in pairs]}
    theirs = RewardTrainer(
        model=theirs_model,
        args=RewardConfig(output_dir=str(tmp_path / "theirs"), report_to="none", bf16=False, use_cpu=True, center_rewards_coefficient=0.01),
        train_dataset=Dataset.from_dict({**columns, **({"margin": margins} if margin else {})}),
        processing_class=tokenizer,
    )
    assert type(theirs.data_collator).__name__ == "DataCollatorForPreference"
    assert not any(cls.__module__.startswith("trl") for cls in type(ours).__mro__)  # TRL is the oracle only
    # no router aux loss on an MoE, as TRL adds none: the config keeps the forward from collecting router logits
    assert not ours.loss.aux.enabled and not getattr(unwrap(ours.model).config, "output_router_logits", False)
    ours.model.train()
    theirs.model.train()
    # the whole training set as one optimizer step of one micro-batch, counted as the Trainer counts a step
    batch = ours.data_collator([vars(row) for row in data.train.rows])
    if margin:  # in the batch's pair order (rows as packed), each pair's own
        index = {tuple(p.chosen.input_ids): i for i, p in enumerate(pairs)}
        batch["margin"] = torch.tensor([margins[index[tuple(ids)]] for ids in _sequences(batch)[:len(pairs)]])
    batches, _ = ours.get_batch_samples(iter([batch]), 1, torch.device("cpu"))
    assert ours.step_counts.units == len(pairs) and ours.step_counts.micro_batches == 1
    loss = ours.compute_loss(ours.model, ours._prepare_inputs(batches[0]))
    theirs_batch = theirs.data_collator([theirs.train_dataset[i] for i in range(len(pairs))])
    assert ("margin" in theirs_batch) == margin
    expected = theirs.compute_loss(theirs.model, theirs_batch)
    assert abs(loss.item() - expected.item()) <= TOL
    assert loss.item() > 0.1  # an untrained head: a real loss, not a saturated one
    metrics = ours.metrics.read("train", ours.accelerator)  # what the next logging step logs
    assert metrics.keys() == set(rm.METRICS)
    for key, value in theirs._metrics["train"].items():
        if key == "num_tokens":  # TRL's running count of real tokens: ours is the Trainer's own (throughput)
            assert ours.real_tokens == value[-1] > 0
            continue
        assert abs(metrics[key] - value[-1]) <= TOL * max(1.0, abs(value[-1])), key
    assert metrics.keys() == theirs._metrics["train"].keys() - {"num_tokens"}
    loss.backward()
    expected.backward()
    theirs_grads = dict(theirs.model.named_parameters())
    compared = 0
    for name, param in ours.model.named_parameters():
        if param.requires_grad:
            other = theirs_grads[name].grad
            assert other is not None and param.grad is not None, name
            assert (param.grad - other).abs().max().item() <= TOL * max(1.0, other.abs().max().item()), name
            compared += 1
    if lora:  # the head trains in full beside the adapters, the routed experts (fused weights) have theirs
        names = [n for n, p in ours.model.named_parameters() if p.requires_grad]
        assert any("score.modules_to_save" in n for n in names) and any("experts" in n and "lora" in n for n in names)
    assert compared > 10


# ---------------------------------------------------------------------------------------------------------------
# Runs: the CLI, with the trained model's own rewards captured at the end (Method.finish)


def _trained(tmp: Path, model_dir: Path, lora: dict | None, steps: int, lr: float, model: dict | None = None) -> tuple[Path, dict]:
    """`erniekit-lite train` of an rm recipe; returns the run dir and, per training sequence (token ids), the reward the
    trained model in memory gives it (packed rows through the trainer's forward)."""
    from erniekit_lite.cli import main
    from erniekit_lite.train import rm

    captured = {}

    def finish(trainer, tokenizer, recipe, out, log):
        trainer.model.eval()
        with torch.no_grad():
            for row in trainer.train_dataset:
                batch = trainer.data_collator([row])
                batch.pop("token_slots")
                values = trainer.model(**batch).logits[:, 0].tolist()
                captured.update(zip(map(tuple, _sequences(batch)), values))

    recipe = write_recipe(tmp / "rm.yaml", model_dir, method="rm", data={"train": [str(PAIRS)]}, lora=lora, out=tmp / "run", model=model,
                          train={"learning_rate": lr, "lr_scheduler_type": "cosine", "warmup_steps": 2, "max_steps": steps,
                                 "per_device_train_batch_size": 2, "activation_checkpointing": False, "logging_steps": 5,
                                 "save_strategy": "no", "seed": 0})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rm, "METHOD", replace(rm.METHOD, finish=finish))
        assert main(["train", str(recipe)]) == 0
    return tmp / "run", captured


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_dense_dir):
    # 10 steps at lr 5e-3 (cosine, 2 warm-up steps), 2 packed rows per step: all 8 pairs each step
    return _trained(tmp_path_factory.mktemp("rm-lora"), tiny_dense_dir, {"r": 8, "alpha": 16}, steps=10, lr=5e-3)


def test_cli_run_learns_the_training_pairs(lora_run):
    run, captured = lora_run
    results = json.loads((run / "train_results.json").read_text())
    assert results["accuracy"] > 0.9 and results["train_samples"] == 8
    model = reward.load_reward_model(str(run))
    scores = model.score(_items())
    accuracy = sum(c > r for c, r in zip(scores[0::2], scores[1::2])) / 8
    assert accuracy > 0.9
    adapter = json.loads((run / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and "score" in adapter["modules_to_save"]
    card = (run / "README.md").read_text()
    assert "reward model (TRL RewardTrainer" in card and "load_reward_model" in card and "pipeline_tag: text-classification" in card


def test_score_renders_items_as_training_did_and_equals_the_trainers_reward(lora_run):
    run, captured = lora_run
    model = reward.load_reward_model(str(run))  # a fresh load of the saved adapter and head
    items = _items()
    ids = model.encode(items)
    assert set(map(tuple, ids)) == set(captured)  # the same tokens as the training rows, item by item
    scores = model.score(items)
    for item_ids, value in zip(ids, scores):
        assert abs(value - captured[tuple(item_ids)]) <= TOL
    # the other item forms render the same ids: prompt/completion messages, a conversation, a TRL reward-function call
    prompt, completion = items[0]
    forms = [{"prompt": prompt, "completion": completion},
             {"prompt": [{"role": "user", "content": prompt}], "completion": [{"role": "assistant", "content": completion}]},
             [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
             {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]}]
    assert model.encode(forms) == [ids[0]] * len(forms)
    assert model(prompts=[prompt], completions=[completion]) == pytest.approx([scores[0]], abs=TOL)
    assert model.__name__ == "reward_model"


def test_lora_run_reloads_in_transformers_and_merges(lora_run, tmp_path):
    run, captured = lora_run
    items = _items()[:4]
    expected = reward.load_reward_model(str(run)).score(items)
    # a fresh process: transformers' Auto class (its peft integration loads base + adapter + head) once erniekit-lite's
    # reward module is imported; the adapter dir carries no config, so the one output is said
    code = (
        "import json, sys, torch\n"
        "import erniekit_lite.model.reward as reward\n"
        "from transformers import AutoModelForSequenceClassification, AutoTokenizer\n"
        f"model = AutoModelForSequenceClassification.from_pretrained({str(run)!r}, num_labels=1)\n"
        f"tokenizer = AutoTokenizer.from_pretrained({str(run)!r})\n"
        f"print(json.dumps([type(model).__name__, reward.RewardModel(model, tokenizer, 128).score({items!r})]))\n"
    )
    name, fresh = json.loads(_python(code).strip().splitlines()[-1])
    assert name == "Ernie4_5ForSequenceClassification"
    assert fresh == pytest.approx(expected, abs=TOL)

    from erniekit_lite.cli import main

    assert main(["merge", str(run), "--out", str(tmp_path / "merged")]) == 0
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["architectures"] == ["Ernie4_5ForSequenceClassification"] and len(config["id2label"]) == 1
    merged = reward.load_reward_model(str(tmp_path / "merged"), max_length=128)
    assert merged.score(items) == pytest.approx(expected, abs=TOL)


def test_full_run_saves_a_model_auto_class_loads_in_a_fresh_process(tmp_path, tiny_dense_dir):
    run, captured = _trained(tmp_path, tiny_dense_dir, None, steps=3, lr=1e-3)  # full fine-tuning, 3 steps
    assert json.loads((run / "config.json").read_text())["architectures"] == ["Ernie4_5ForSequenceClassification"]
    sequences = sorted(captured)[:4]
    code = (
        "import json, torch\n"
        "import erniekit_lite.model.reward\n"
        "from transformers import AutoModelForSequenceClassification\n"
        f"model = AutoModelForSequenceClassification.from_pretrained({str(run)!r}).eval()\n"
        "with torch.no_grad():\n"
        f"    print(json.dumps([model(input_ids=torch.tensor([ids])).logits[0, 0].item() for ids in {[list(s) for s in sequences]!r}]))\n"
    )
    fresh = json.loads(_python(code).strip().splitlines()[-1])
    assert fresh == pytest.approx([captured[s] for s in sequences], abs=TOL)
    # without erniekit-lite's module transformers has no such class
    failed = subprocess.run([sys.executable, "-c", "from transformers import AutoModelForSequenceClassification as A; "
                             f"A.from_pretrained({str(run)!r})"], capture_output=True, text=True)
    assert failed.returncode != 0 and "Unrecognized configuration class" in failed.stderr


def test_moe_lora_adapts_the_experts_and_reloads_and_merges(tmp_path, tiny_moe_dir):
    run, captured = _trained(tmp_path, tiny_moe_dir, {"r": 4, "alpha": 8}, steps=2, lr=5e-3)
    from safetensors import safe_open

    with safe_open(str(run / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any("shared_experts" in k for k in keys) and any(".mlp.experts.lora_A" in k for k in keys)  # the fused routed experts
    assert any(k.endswith("score.weight") for k in keys)
    model = reward.load_reward_model(str(run))
    ids = model.encode(_items())
    for item_ids, value in zip(ids, model.score(_items())):
        assert abs(value - captured[tuple(item_ids)]) <= TOL
    from erniekit_lite.cli import main

    assert main(["merge", str(run), "--out", str(tmp_path / "merged")]) == 0
    merged = reward.load_reward_model(str(tmp_path / "merged"), max_length=128)
    # the merged experts hold W + BA in fp32: equal up to rounding
    assert merged.score(_items()) == pytest.approx([captured[tuple(i)] for i in ids], abs=1e-4)


def test_qlora_run_scores_as_it_trained(tmp_path, tiny_dense_dir):
    """The head stays an unquantized Linear and trains in the model's dtype (TRL casts every trained parameter of a
    4-bit model to bf16); load_reward_model puts the adapter back on the 4-bit base."""
    need_module("bitsandbytes", TEST_EXTRA)
    run, captured = _trained(tmp_path, tiny_dense_dir, {"r": 8, "alpha": 16}, steps=3, lr=5e-3, model={"load_in_4bit": True})
    model = reward.load_reward_model(str(run))
    assert getattr(unwrap(model.model).model.layers[0].self_attn.q_proj.base_layer, "quant_state", None) is not None
    for item_ids, value in zip(model.encode(_items()), model.score(_items())):
        assert abs(value - captured[tuple(item_ids)]) <= TOL


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


# ---------------------------------------------------------------------------------------------------------------
# validate, refusals


def test_validate_builds_the_reward_model_on_meta(tiny_dense_dir, tmp_path):
    from erniekit_lite.plan import plan
    from erniekit_lite.model.lora import apply_lora

    r = _recipe(tiny_dense_dir, tmp_path, lora={"r": 8, "alpha": 16})
    info = plan(r, log=lambda *a: None)
    assert info["architecture"] == "Ernie4_5ForSequenceClassification" and info["train_pairs"] == 8
    real = apply_lora(reward.load_model(str(tiny_dense_dir)), r.lora)
    assert info["trainable_parameters"] == sum(p.numel() for p in real.parameters() if p.requires_grad)
    assert info["parameters"] == sum(p.numel() for p in reward.load_model(str(tiny_dense_dir)).parameters())


def test_bad_input_is_one_line(lora_run, tiny_dense_dir, tmp_path, capsys):
    run, _ = lora_run
    model = reward.load_reward_model(str(run))
    for bad, says in [("Who are you?", "expected a list"), (["Who are you?"], "bare string"),
                      ([[{"role": "user", "content": "hi"}]], "must end with the assistant message"),
                      ([("x " * 300, "y")], "prompt alone")]:
        with pytest.raises(UserError, match=says) as error:
            model.score(bad)
        assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="not a reward model"):
        reward.load_reward_model(str(tiny_dense_dir))

    capsys.readouterr()  # the loads' progress bars
    # Every command that generates or scores text as a causal LM refuses it in one line, before writing anything
    for command in (["chat", run, "--prompt", "hi"], ["serve", run], ["eval", run, "--data", str(PAIRS)],
                    ["export", run, "--to", "gguf", "--out", str(tmp_path / "gguf")]):
        code, _, err = run_cli(capsys, *command)
        assert code == 2 and "a reward model (method: rm)" in err and f"`{command[0]}` cannot use" in err, (command, err)
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "gguf").exists() and not Path(str(run) + ".merged").exists()
    cases = [
        ({"data": {"train": [str(PAIRS.parent / "identity.jsonl")]}}, "preference"),  # SFT data, no pairs
        ({"train": {"chat_template_path": "x.jinja"}}, "train.chat_template_path"),
        ({"train": {"max_length": 64}}, "data.max_length"),
    ]
    for changes, says in cases:
        recipe = write_recipe(tmp_path / "bad.yaml", tiny_dense_dir, method="rm", out=tmp_path / "bad-run",
                              **{"data": {"train": [str(PAIRS)]}, **changes})
        code, _, err = run_cli(capsys, "train", recipe)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    causal_adapter = tmp_path / "sft-lora"
    causal_adapter.mkdir()
    (causal_adapter / "adapter_config.json").write_text(json.dumps({"task_type": "CAUSAL_LM", "base_model_name_or_path": str(tiny_dense_dir)}))
    recipe = write_recipe(tmp_path / "bad.yaml", causal_adapter, method="rm", data={"train": [str(PAIRS)]}, out=tmp_path / "bad-run")
    code, _, err = run_cli(capsys, "validate", recipe)
    assert code == 2 and "merge it first" in err and len(err.strip().splitlines()) == 1


def test_quickstart_recipe_is_valid(tiny_dense_dir, tmp_path):
    r = recipes.load(Path(__file__).resolve().parents[1] / "recipes" / "quickstart-rm.yaml", [f"model.path={tiny_dense_dir}"])
    assert r.method == "rm" and r.lora is not None
    reference = recipes.load(Path(__file__).resolve().parents[1] / "recipes" / "ernie-4.5-0.3b" / "rm-lora.yaml")
    assert reference.method == "rm"
