"""GRPO (`method: grpo`): prompts from every SFT format, the built-in and user rewards, packed completion scores equal
each sequence alone, TRL's GRPO loss / metrics / LoRA gradients equal on the packed row and on TRL's own padded batch,
equal rewards give zero advantage, bad reward entries are one line, and a CLI run whose mean reward rises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import run_cli, write_recipe

from erniekit_lite import rewards
from erniekit_lite.data.load import Record
from erniekit_lite.data.prompts import detect_prompt_format, prompt_ids, to_prompt
from erniekit_lite.data.template import template_for
from erniekit_lite.data.tokenize import Tokenizer
from erniekit_lite.errors import DataError, UserError
from erniekit_lite.model.load import load_model

ROOT = Path(__file__).resolve().parents[1]
ARITH = ROOT / "recipes" / "data" / "grpo_arith.jsonl"


# --- prompts --------------------------------------------------------------------------------------------------------

USER = {"role": "user", "content": "What is 2 + 3?"}


@pytest.mark.parametrize("data, messages, answer", [
    ({"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}, [USER], "2 + 3 = 5\n#### 5"),
    ({"prompt": "What is 2 + 3?", "answer": 5}, [USER], "5"),
    ({"prompt": [{"role": "system", "content": "S"}, USER]}, [{"role": "system", "content": "S"}, USER], None),
    ({"instruction": "What is 2 + 3?"}, [USER], None),
    ({"instruction": "What is 2 + 3?", "output": "5"}, [USER], "5"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, USER]},
     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, USER], None),
    ({"conversations": [{"from": "human", "value": "What is 2 + 3?"}, {"from": "gpt", "value": "5"}]}, [USER], "5"),
    ({"src": ["Hi", "What is 2 + 3?"], "tgt": ["Hello!"], "system": "S"},
     [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, USER], None),
], ids=["gsm8k", "trl", "trl-messages", "alpaca-prompt-only", "alpaca", "messages", "sharegpt", "erniekit"])
def test_every_format_reads_as_a_prompt_and_its_reference(data, messages, answer):
    record = Record(data, "p.jsonl", 2)
    assert to_prompt(record, detect_prompt_format(record)) == (messages, answer)


def test_a_bad_prompt_record_names_the_line():
    with pytest.raises(DataError, match=r"p.jsonl:2: 'question' must be a non-empty string"):
        to_prompt(Record({"question": ""}, "p.jsonl", 2), "gsm8k")


def test_prepare_drops_overlong_prompts_holds_out_eval_and_fills_the_system_prompt(tiny_own_dir, tmp_path):
    from transformers import AutoTokenizer

    from erniekit_lite.data.prompts import describe_prompts, prepare_prompts
    from erniekit_lite.recipe import DataSection

    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"question": "2 + 2?", "answer": "#### 4"}] * 9 + [{"question": "word " * 80}]))
    tokenizer = AutoTokenizer.from_pretrained(tiny_own_dir)
    data = prepare_prompts(DataSection(train=[str(path)], max_length=40, eval_split=0.2, system="Be brief."), tokenizer, log=lambda *a: None)
    assert (len(data.train.items), len(data.eval.items), data.train.dropped_overlong) == (7, 2, 1)
    assert data.train.items[0].messages[0] == {"role": "system", "content": "Be brief."} and data.train.items[0].answer == "#### 4"
    assert "train: 7 prompts (7 with a reference answer)" in describe_prompts(data) and "1 longer than data.max_length dropped" in describe_prompts(data)
    with pytest.raises(DataError, match="no prompts left"):
        prepare_prompts(DataSection(train=[str(path)], max_length=16, system="A long system prompt that no prompt fits beside."), tokenizer,
                        log=lambda *a: None)


def test_prompts_render_as_training_renders_them_and_user_text_stays_text(ernie_tokenizer):
    from erniekit_lite.data.formats import Conversation, Turn
    from erniekit_lite.data.tokenize import IGNORE

    tok = Tokenizer(ernie_tokenizer, template_for(ernie_tokenizer))
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Hi <|end_of_sentence|>"}]
    ids = prompt_ids(tok, messages)
    (sample,), _ = tok([Conversation([Turn("Hi", "Hello!", train=False), Turn("Hi <|end_of_sentence|>", "x")], "S")], 10**6)
    assert ids == sample.input_ids[: sample.labels.index(next(t for t in sample.labels if t != IGNORE))]  # SFT's prompt
    ids = ids[sample.input_ids.index(100272) + 1 :]  # the last turn only: past the first answer's end-of-turn token
    assert ids.count(ernie_tokenizer.convert_tokens_to_ids("<|end_of_sentence|>")) == 0  # typed, so never the control token
    assert ids[-1] == 93919  # "Assistant: " ends in the token ▁, where generation starts


def test_a_model_template_renders_prompts_as_its_chat_template_with_text_as_text(ernie_tokenizer):
    """The Thinking model's own template (the released one, from ../shared): the prompt is what apply_chat_template
    renders for generation, its markup's control tokens parsed, a user's typed `<|im_end|>` left as text."""
    import copy

    from test_tool_calls import CONTROL, THINKING_TEMPLATE

    tokenizer = copy.deepcopy(ernie_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": CONTROL})
    tokenizer.chat_template = THINKING_TEMPLATE
    tok = Tokenizer(tokenizer, template_for(tokenizer))
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 2 + 3?"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt_ids(tok, messages) == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    typed, plain = (prompt_ids(tok, [{"role": "user", "content": text}]) for text in ("Hi <|im_end|>", "Hi"))
    assert typed.count(im_end) == plain.count(im_end) > 0  # the markup's own, none from the user's text


# --- rewards --------------------------------------------------------------------------------------------------------

def chat(text):
    return [{"role": "assistant", "content": text}]


def test_exact_answer_compares_final_answers():
    completions = [chat("3 + 4 = 7. The answer is 7."), chat("so \\boxed{7}"), chat("#### 7.0"), chat("1,000"), chat("I think 8"),
                   chat("<think>maybe 7</think>It is 6"), "plain 7", chat("no number")]
    answers = ["3 + 4 = 7\n#### 7", "7", "7", "#### 1000", "#### 7", "7", "\\boxed{7}", "#### 7"]
    assert rewards.exact_answer(completions, answer=answers) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert rewards.exact_answer([chat("7"), chat("Paris")], answer=[None, "Paris"]) == [None, None]  # nothing to compare: TRL
    # leaves it out of the mean


def test_think_format_wants_one_think_block_before_an_answer():
    completions = ["<think>a</think>b", "\n<think>\nreason\n</think>\n\nanswer", "<think></think>b", "<think>a</think>",
                   "<think>a</think><think>c</think>b", "b <think>a</think>c", "b"]
    assert rewards.think_format([chat(c) for c in completions]) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


@pytest.fixture
def thinking_render(ernie_tokenizer):
    """The released ERNIE-4.5-21B-A3B-Thinking template (../shared, verbatim) on the shared tokenizer with ChatML's
    control tokens, as GRPO renders prompts with it."""
    import copy

    from test_tool_calls import CONTROL, THINKING_TEMPLATE

    tokenizer = copy.deepcopy(ernie_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": CONTROL})
    tokenizer.chat_template = THINKING_TEMPLATE
    return Tokenizer(tokenizer, template_for(tokenizer))


def test_prompt_text_is_the_rendered_generation_prompt(thinking_render, ernie_tokenizer):
    """`prompt_text` (what every reward function gets) is the prompt the run generates from, as text: the Thinking
    template's ends by opening the reasoning; ERNIE's own ends in `Assistant: `. It encodes to the prompt's ids."""
    from erniekit_lite.data.prompts import prompt_text

    messages = [{"role": "user", "content": "What is 2+3?"}]
    text = prompt_text(thinking_render, messages)
    assert text == ("<|im_start|>system\n<global_setting>\nthink_mode=True\n</global_setting><|im_end|>\n\n"
                    "<|im_start|>user\nWhat is 2+3?<|im_end|>\n\n<|im_start|>assistant\n<think>\n")
    assert text == thinking_render.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert thinking_render.tokenizer.decode(prompt_ids(thinking_render, messages)) == text
    ernie = Tokenizer(ernie_tokenizer, template_for(ernie_tokenizer))
    assert prompt_text(ernie, [{"role": "system", "content": "S"}, *messages]) == "<|begin_of_sentence|>S\nUser: What is 2+3?\nAssistant: "


def test_think_format_reads_whether_the_prompt_opened_the_reasoning(thinking_render):
    """After the real Thinking prompt (it ends in `<think>\\n`), the well-formed completion closes the reasoning and
    answers; opening it again is malformed. After a prompt that does not open it, the completion must."""
    from erniekit_lite.data.prompts import prompt_text

    opened = prompt_text(thinking_render, [{"role": "user", "content": "What is 2+3?"}])
    completions = [chat("2 + 3 = 5.\n</think>\n\n<response>\n5\n</response>"),  # the template's own shape
                   chat("<think>\n2 + 3 = 5.\n</think>\n\n<response>\n5\n</response>"),  # opened twice
                   chat("2 + 3 = 5, so 5"),  # never closed
                   chat("\n</think>\n5"),  # no reasoning
                   chat("2 + 3 = 5.\n</think>\n")]  # no answer
    assert rewards.think_format(completions, prompt_text=[opened] * 5) == [1.0, 0.0, 0.0, 0.0, 0.0]
    plain = "User: What is 2+3?\nAssistant: "
    assert rewards.think_format(completions, prompt_text=[plain] * 5) == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert rewards.think_format(completions, prompts=[opened] * 5) == [1.0, 0.0, 0.0, 0.0, 0.0]  # string prompts read too
    assert rewards.think_format(completions) == [0.0, 1.0, 0.0, 0.0, 0.0]  # no prompt: as before


def test_exact_answer_reads_the_response_and_lists_and_no_unclosed_reasoning(thinking_render):
    from erniekit_lite.data.prompts import prompt_text

    opened = prompt_text(thinking_render, [{"role": "user", "content": "List the primes below 6."}])
    completions = [chat("Primes: 2, 3 and 5; that is 3 of them.\n</think>\n\n<response>\n2,3,5\n</response>"),
                   chat("Checking 1,234 and 99.\n</think>\n\n<response>\nIt is 1,234.\n</response>"),
                   chat("The primes are 2, 3, 5"),  # reasoning never closed: no answer
                   chat("so 2,3,5\n</think>\n<response>\n235\n</response>")]
    answers = ["2,3,5", "1234", "2,3,5", "2,3,5"]
    assert rewards.exact_answer(completions, answer=answers, prompt_text=[opened] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert rewards.exact_answer([chat("<think>still 7")], answer=["7"]) == [0.0]  # opened, never closed
    assert rewards.exact_answer([chat("2, 3,5."), chat("235"), chat("1,234"), chat("1234.0")], answer=["2,3,5", "2,3,5", "1234", "1,234"]) \
        == [1.0, 0.0, 1.0, 1.0]


def test_exact_answer_reads_the_last_number_of_prose_not_a_comma_list():
    """A comma list is the answer only when the answer text is nothing but numbers (or boxed, or after ####); in prose
    the answer is the last number, `1,234` one number and `3, 45` two (before: "3,45" and "2019,250", scored 0)."""
    completions = [chat("So by day 3, 45 birds are left."), chat("In 2019, 250 people came."), chat("In 2019,250 people came."),
                   chat("The total is 1,234 apples."), chat("We had 3,45 left."),  # no thousands group: two numbers
                   chat("Reasoning.\n</think>\n\n<response>\nOn day 3, 45 birds remain.\n</response>"),
                   chat("2, 3, 5"), chat("\\boxed{2, 3, 5}"), chat("#### 2, 3, 5"), chat("So by day 3, 44 birds are left.")]
    answers = ["#### 45", "#### 250", "#### 250", "#### 1234", "#### 45", "45", "2,3,5", "2,3,5", "2,3,5", "#### 45"]
    assert rewards.exact_answer(completions, answer=answers) == [1.0] * 9 + [0.0]
    assert rewards.final_answer("The primes are 2, 3, 5") == "5"  # prose: its last number, not a list


def test_exact_answer_reads_a_minus_only_at_a_words_start_and_an_exponent_whole():
    """"Pages 12-15" ends on 15 (it read -15), "1.2e3" is 1200 (it read 3); a minus that starts a word stays."""
    completions = [chat("Pages 12-15."), chat("That is 1.2e3 in all"), chat("The answer is -15"), chat("about 2.5E-3.")]
    assert [rewards.final_answer(c[0]["content"]) for c in completions] == ["15", "1200", "-15", "0.0025"]
    assert rewards.exact_answer(completions, answer=["#### 15", "#### 1200", "#### -15", "#### 0.0025"]) == [1.0] * 4


def test_length_penalises_tokens_beyond_the_target():
    ids = [[0] * n for n in (5, 10, 15, 30)]
    assert rewards.length([chat("")] * 4, completion_ids=ids, target=10) == [0.0, 0.0, -0.5, -2.0]


def entries(*raw):
    from erniekit_lite.recipe import RewardEntry

    return [RewardEntry.model_validate(r) for r in raw]


def test_a_user_reward_from_a_file_and_built_ins_become_named_checked_functions(tmp_path):
    (tmp_path / "mine.py").write_text("def shout(completions, **kwargs):\n    return [float(c[0]['content'].isupper()) for c in completions]\n")
    funcs, weights = rewards.reward_functions(entries({"function": f"{tmp_path}/mine.py:shout", "weight": 2},
                                                      {"name": "length", "args": {"target": 1}}))
    assert [f.__name__ for f in funcs] == ["shout", "length"] and weights == [2.0, 1.0]
    assert funcs[0](prompts=[[USER]] * 2, completions=[chat("HI"), chat("hi")]) == [1.0, 0.0]
    assert funcs[1](prompts=[[USER]], completions=[chat("a b")], completion_ids=[[1, 2, 3]]) == [-2.0]


def test_a_method_rm_reward_model_is_a_reward_function(tiny_own_dir, tmp_path):
    from transformers import AutoTokenizer

    from erniekit_lite.model.reward import AutoRewardModel, load_reward_model

    AutoRewardModel.from_pretrained(str(tiny_own_dir)).save_pretrained(tmp_path / "rm")  # what a full `method: rm` run saves
    AutoTokenizer.from_pretrained(tiny_own_dir).save_pretrained(tmp_path / "rm")
    (func,), weights = rewards.reward_functions(entries({"model": str(tmp_path / "rm"), "weight": 0.5}))
    prompts, completions = [[USER], [{"role": "system", "content": "S"}, USER]], [chat("5"), chat("It is 5.")]
    values = func(prompts=prompts, completions=completions, completion_ids=[[1], [2, 3]], answer=["5", "5"])
    assert func.__name__ == "reward_model" and weights == [0.5]
    assert values == load_reward_model(str(tmp_path / "rm")).score([{"prompt": p, "completion": c} for p, c in zip(prompts, completions)])
    assert len(set(values)) == 2  # two different sequences, two rewards


@pytest.mark.parametrize("entry, source, message", [
    ({"function": "{dir}/broken.py:f"}, "import nothing_here_at_all\n",
     "rewards.0.function: cannot import '{dir}/broken.py' (ModuleNotFoundError: No module named 'nothing_here_at_all'); "
     "expected 'package.module:function' or 'path/to/file.py:function'"),
    ({"function": "{dir}/missing.py:f"}, None, "rewards.0.function: '{dir}/missing.py:f': no file {dir}/missing.py"),
    ({"function": "{dir}/ok.py:g"}, "def f(**kw): return []\n", "rewards.0.function: '{dir}/ok.py' has no function 'g'"),
    ({"function": "no_such_package_xyz.rewards:f"}, None, "rewards.0.function: cannot import 'no_such_package_xyz.rewards' "
     "(ModuleNotFoundError"),
    ({"name": "length", "args": {"goal": 3}}, None, "rewards.0.args: unknown argument 'goal' for length; expected target"),
    ({"name": "length", "args": {"target": 0}}, None, "rewards.0.args.target: expected a whole number of tokens, at least 1 (got 0)"),
    ({"name": "think_format", "args": {"prompt_text": "<think>\n"}}, None,
     "rewards.0.args: unknown argument 'prompt_text' for think_format; expected none"),  # the trainer passes it
], ids=["import-error", "no-file", "no-function", "no-module", "unknown-arg", "bad-target", "call-input-as-arg"])
def test_a_reward_that_cannot_be_made_is_one_line(tmp_path, entry, source, message):
    if source is not None:
        (tmp_path / entry["function"].split("/")[-1].split(":")[0]).write_text(source)
    entry = {k: v.replace("{dir}", str(tmp_path)) if isinstance(v, str) else v for k, v in entry.items()}
    with pytest.raises(UserError) as error:
        rewards.reward_functions(entries(entry))
    assert str(error.value).startswith(message.replace("{dir}", str(tmp_path))) and "\n" not in str(error.value)


@pytest.mark.parametrize("body, message", [
    ("return ['high', 0.0]", "rewards.0 (f): returned 'high' for completion 0; expected a float (or None)"),
    ("return [True, 0.0]", "rewards.0 (f): returned True for completion 0; expected a float (or None)"),
    ("return [1.0]", "rewards.0 (f): returned 1 values for 2 completions; expected a list of one float (or None) per completion"),
    ("return 1.0", "rewards.0 (f): returned 1.0 for 2 completions; expected a list"),
    ("return [float('nan'), 0.0]", "rewards.0 (f): returned nan for completion 0; expected a finite float"),
], ids=["text", "bool", "count", "scalar", "nan"])
def test_a_reward_returning_something_else_than_floats_is_one_line(tmp_path, body, message):
    (tmp_path / "r.py").write_text(f"def f(completions, **kwargs):\n    {body}\n")
    (func,), _ = rewards.reward_functions(entries({"function": f"{tmp_path}/r.py:f"}))
    with pytest.raises(UserError, match=rf"^{__import__('re').escape(message)}"):
        func(prompts=[[USER]] * 2, completions=[chat("a"), chat("b")])


@pytest.mark.parametrize("changes, message", [
    ({"rewards": [{"name": "exact"}]}, "rewards.0.name: 'exact' is not one of exact_answer, think_format, length; did you mean 'exact_answer'?"),
    ({"rewards": [{"name": "length", "function": "m:f"}]}, "rewards.0: expected exactly one of name"),
    ({"rewards": [{"weight": 1}]}, "rewards.0: expected exactly one of name"),
    ({"rewards": [{"function": "just_a_module"}]}, "rewards.0: function: expected 'package.module:function'"),
    ({"rewards": [{"name": "length", "wieght": 1}]}, "unknown key 'wieght' in rewards.0; did you mean 'weight'?"),
    ({"rewards": None}, "method: grpo needs rewards:"),
    ({"method": "sft"}, "rewards: is for method: grpo (this recipe is method: sft)"),
    ({"train": {"reward_weights": [1.0]}}, "train.reward_weights is set by the recipe; use rewards (each entry's weight) instead"),
    ({"train": {"num_generations": "many"}}, "train.num_generations: expected a number (got 'many')"),
], ids=["unknown-name", "two-sources", "no-source", "no-colon", "typo", "missing", "not-grpo", "weights-in-train", "bad-train"])
def test_bad_reward_entries_are_one_line_naming_the_key(tmp_path, tiny_own_dir, changes, message):
    from erniekit_lite import recipe as recipes
    from erniekit_lite.errors import RecipeError

    raw = {"model": {"path": str(tiny_own_dir)}, "method": "grpo", "data": {"train": [str(ARITH)]},
           "rewards": [{"name": "exact_answer"}], "output": {"dir": str(tmp_path / "out")}, **changes}
    path = tmp_path / "r.yaml"
    path.write_text(__import__("yaml").safe_dump(raw))
    with pytest.raises(RecipeError) as error:
        recipes.load(path)
    assert message in str(error.value) and "\n" not in str(error.value)


# --- packed scoring -------------------------------------------------------------------------------------------------

def padded_group(generator, prompts=(5, 3, 7, 4), completions=(4, 6, 2, 5), vocab=500):
    """TRL's layout: left-padded prompts + right-padded completions, [B, P + C], and its attention mask."""
    P, C = max(prompts), max(completions)
    ids = torch.zeros(len(prompts), P + C, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, P - p : P + c] = torch.randint(5, vocab, (p + c,), generator=generator)
        mask[i, P - p : P + c] = 1
    return ids, mask, C


@pytest.mark.parametrize("arch, temperature", [("dense", 1.0), ("dense", 0.7), ("moe", 0.7)])
def test_packed_completion_logps_equal_each_sequence_alone(request, arch, temperature):
    from erniekit_lite.train import scored
    from erniekit_lite.train.grpo_scoring import MARK, packed_inputs, to_layout

    model_dir = request.getfixturevalue("tiny_own_dir" if arch == "dense" else "tiny_moe_dir")
    model = load_model(str(model_dir), attn_implementation="packed_sdpa").eval()
    scored.take(model)
    ids, mask, C = padded_group(torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(**packed_inputs(ids, mask, C), temperature=temperature, entropy=True, **{MARK: True})
        logps, entropy = to_layout(out["log_probs"], mask, C), to_layout(out["entropy"], mask, C)
        for i in range(len(ids)):
            seq = ids[i][mask[i].bool()]
            n = int(mask[i, -C:].sum())
            logits = model(input_ids=seq[None]).logits[0, -n - 1 : -1] / temperature
            alone = torch.log_softmax(logits.double(), -1)
            torch.testing.assert_close(logps[i, :n].double(), alone.gather(-1, seq[-n:, None])[:, 0], atol=1e-5, rtol=0)
            torch.testing.assert_close(entropy[i, :n].double(), -(alone.exp() * alone).sum(-1), atol=1e-5, rtol=0)
            assert not logps[i, n:].any()  # padding stays zero, as in TRL's layout


def grpo_trainer(model_dir, tmp_path, reward_funcs, **config):
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    from erniekit_lite.train.grpo import prompts_dataset
    from erniekit_lite.data.prompts import PromptItem
    from erniekit_lite.train.grpo_trainer import ErnieGRPOTrainer

    model = load_model(str(model_dir), attn_implementation="packed_sdpa")
    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                    report_to="none", bf16=False, seed=0, learning_rate=1e-2, logging_steps=1, save_strategy="no")
    args = GRPOConfig(**{**settings, **config})
    items = [PromptItem([{"role": "user", "content": f"What is {i} + 1?"}], f"#### {i + 1}", 0) for i in range(4)]
    return ErnieGRPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=prompts_dataset(items),
                            processing_class=AutoTokenizer.from_pretrained(model_dir),
                            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))


@pytest.mark.parametrize("arch, loss_type", [("dense", "grpo"), ("dense", "dapo"), ("dense", "dr_grpo"), ("moe", "dapo")])
def test_grpo_loss_metrics_and_lora_gradients_equal_trl_on_its_padded_batch(request, tmp_path, arch, loss_type):
    """MoE: with the router aux loss (the config's coefficient), which TRL adds in `_compute_loss`."""
    from erniekit_lite.train.grpo_trainer import plain_attention, _inner

    model_dir = request.getfixturevalue("tiny_own_dir" if arch == "dense" else "tiny_moe_dir")
    trainer = grpo_trainer(model_dir, tmp_path, [rewards.length], beta=0.1, loss_type=loss_type, temperature=0.8)
    assert trainer.aux_loss_enabled == (arch == "moe")
    torch.manual_seed(1)
    with torch.no_grad():  # move the adapter away from the reference so KL and ratios are not trivial
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ids, mask, C = padded_group(torch.Generator().manual_seed(2), prompts=(6, 4, 6, 5), completions=(3, 8, 5, 1))
    P = ids.shape[1] - C
    base = {"prompt_ids": ids[:, :P], "prompt_mask": mask[:, :P], "completion_ids": ids[:, P:], "completion_mask": mask[:, P:],
            "advantages": torch.tensor([1.0, -0.5, 0.25, -0.75]), "num_items_in_batch": mask[:, P:].sum()}
    trainer.current_gradient_accumulation_steps = 1
    results = []
    for packed in (True, False):
        trainer.packed_scoring = packed
        trainer._metrics["train"].clear()
        with plain_attention(_inner(trainer.model)) if not packed else torch.enable_grad():
            with torch.no_grad(), trainer.model.disable_adapter():
                ref, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
            with torch.no_grad():
                old = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)[0] + 0.05 * torch.arange(C)
            trainer.model.zero_grad()
            inputs = {**base, "ref_per_token_logps": ref, "old_per_token_logps": old}
            loss = trainer._compute_loss(trainer.model.train(), inputs)
            loss.backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), ref, dict(trainer._metrics["train"]), grads))
    (loss, ref, metrics, grads), (trl_loss, trl_ref, trl_metrics, trl_grads) = results
    assert loss.abs() > 1e-4 and metrics["kl"][0] > 1e-5  # a real test: the terms are not zero
    torch.testing.assert_close(ref, trl_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, trl_loss, atol=1e-5, rtol=1e-5)
    assert metrics.keys() == trl_metrics.keys()
    for key in metrics:
        assert metrics[key] == pytest.approx(trl_metrics[key], abs=1e-5), key
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert grads.keys() == trl_grads.keys() == set(trained) and len(trained) >= 12  # every adapter matrix has a gradient
    for name in grads:
        torch.testing.assert_close(grads[name], trl_grads[name], atol=1e-5, rtol=1e-4)


def test_equal_rewards_in_a_group_give_zero_advantage(tiny_own_dir, tmp_path):
    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    trainer = grpo_trainer(tiny_own_dir, tmp_path, [constant])
    batch = [row for row in trainer.train_dataset for _ in range(4)][:4]  # one prompt, num_generations completions
    out = trainer._generate_and_score_completions(batch)
    assert out["completion_ids"].shape[0] == 4 and out["completion_mask"].sum() > 0
    assert torch.equal(out["advantages"], torch.zeros(4))
    assert trainer._metrics["train"]["frac_reward_zero_std"] == [1.0]


def test_every_reward_gets_the_prompt_as_generated_from(tiny_own_dir, tmp_path):
    """`prompt_text`: each completion's prompt, rendered for generation: the text of the very ids it was generated
    from, with the template's markup (the messages TRL passes as `prompts` lack it)."""
    seen = {}

    def record(completions, prompt_text, prompts, **kwargs):
        seen["texts"], seen["prompts"] = prompt_text, prompts
        return [0.0] * len(completions)

    trainer = grpo_trainer(tiny_own_dir, tmp_path, [record])
    batch = [row for row in trainer.train_dataset for _ in range(2)][:4]  # two prompts, two completions each
    out = trainer._generate_and_score_completions(batch)
    ids = [row[mask.bool()].tolist() for row, mask in zip(out["prompt_ids"], out["prompt_mask"])]
    assert seen["texts"] == [trainer.processing_class.decode(i) for i in ids]
    assert [m[-1]["content"] for m in seen["prompts"]] == ["What is 0 + 1?"] * 2 + ["What is 1 + 1?"] * 2
    assert all(t.endswith(m[-1]["content"] + "\nAssistant: ") for t, m in zip(seen["texts"], seen["prompts"]))


def test_under_the_thinking_template_rewards_get_prompts_that_open_the_reasoning(tmp_path, ernie_tokenizer_dir):
    """A tiny model whose tokenizer carries the released Thinking template: the trainer generates from prompts that end
    by opening `<think>`, hands every reward that text as `prompt_text`, and `think_format` reads it (a completion
    shaped as the template's answers scores 1 there, one that opens `<think>` again 0)."""
    from transformers import AutoTokenizer

    from erniekit_lite.tiny import write_tiny
    from test_tool_calls import CONTROL, THINKING_TEMPLATE

    model_dir = write_tiny(str(tmp_path / "tiny-thinking"), "dense", str(ernie_tokenizer_dir), hidden_size=32, layers=1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": CONTROL})  # ids below the padded vocabulary
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    seen = {}

    def record(completions, prompt_text, **kwargs):
        seen["texts"], seen["format"] = prompt_text, rewards.think_format(completions, prompt_text=prompt_text)
        seen["completions"] = [rewards.text_of(c) for c in completions]
        return [0.0] * len(completions)

    trainer = grpo_trainer(model_dir, tmp_path, [record], max_completion_length=4)
    batch = [row for row in trainer.train_dataset for _ in range(2)][:4]
    out = trainer._generate_and_score_completions(batch)
    ids = [row[mask.bool()].tolist() for row, mask in zip(out["prompt_ids"], out["prompt_mask"])]
    assert seen["texts"] == [trainer.processing_class.decode(i) for i in ids]
    assert seen["texts"][0] == ("<|im_start|>system\n<global_setting>\nthink_mode=True\n</global_setting><|im_end|>\n\n"
                                "<|im_start|>user\nWhat is 0 + 1?<|im_end|>\n\n<|im_start|>assistant\n<think>\n")
    # the tiny model's 4 tokens close no reasoning: 0 each, as think_format scores them after this prompt
    assert seen["format"] == [0.0] * 4 and all("</think>" not in c for c in seen["completions"])
    shaped = ["1 + 0 = 1.\n</think>\n<response>\n1\n</response>", "<think>\n1.\n</think>\n<response>\n1\n</response>"]
    assert rewards.think_format(shaped, prompt_text=seen["texts"][:2]) == [1.0, 0.0]
    assert rewards.exact_answer(shaped[:1], answer=["#### 1"], prompt_text=seen["texts"][:1]) == [1.0]


# --- a run ----------------------------------------------------------------------------------------------------------

LOW_IDS = "def low_ids(completions, completion_ids, **kwargs):\n    return [sum(t < {limit} for t in ids) / len(ids) for ids in completion_ids]\n"


@pytest.mark.slow
def test_grpo_run_raises_the_mean_reward(tiny_own_dir, tmp_path, capsys):
    """A random tiny model's completions vary in how many of their tokens have ids below 128 (an eighth of the
    vocabulary): that reward moves under a random policy, so its groups carry advantage, and GRPO must raise it (full
    fine-tuning at beta 0, TRL's default: no reference; a KL penalty of 0.02 slows this run to 0.35 by step 15. The
    LoRA reference, the base with the adapter disabled, is checked against TRL's above)."""
    (tmp_path / "reward.py").write_text(LOW_IDS.format(limit=128))
    recipe = write_recipe(
        tmp_path / "r.yaml", tiny_own_dir, method="grpo", data={"train": [str(ARITH)], "max_length": 64},
        rewards=[{"function": f"{tmp_path}/reward.py:low_ids"}, {"name": "exact_answer", "weight": 0.5}],
        train={"num_generations": 4, "max_completion_length": 12, "per_device_train_batch_size": 8, "learning_rate": 5e-2,
               "beta": 0.0, "max_steps": STEPS, "logging_steps": 1, "save_strategy": "no", "activation_checkpointing": False,
               "seed": 0},
    )
    code, out, err = run_cli(capsys, "train", recipe)
    assert code == 0, err
    log = [json.loads(line) for line in (tmp_path / "out" / "progress.jsonl").read_text().splitlines()]
    rewards_logged = [e["rewards/low_ids/mean"] for e in log if e["event"] == "log" and "rewards/low_ids/mean" in e]
    assert len(rewards_logged) == STEPS
    assert rewards_logged[0] < 0.3 and max(rewards_logged[-3:]) >= TARGET, rewards_logged
    last = [e for e in log if "reward" in e][-1]  # what the web UI plots (kl too, when beta > 0)
    assert {"reward", "rewards/low_ids/mean", "rewards/exact_answer/mean", "completions/mean_length", "entropy"} <= last.keys()
    results = json.loads((tmp_path / "out" / "train_results.json").read_text())
    assert results["train_samples"] == 24 and "reward" in results
    assert "mean reward" in out
    card = (tmp_path / "out" / "README.md").read_text()
    assert ("| method | GRPO (dapo, 4 completions per prompt of up to 12 tokens, beta 0; rewards: reward.py:low_ids x 1, "
            "exact_answer x 0.5) |") in card and f"{tmp_path}/reward.py" not in card  # the file by name, not its path


STEPS, TARGET = 15, 0.7  # measured: 0.125 at step 1, 0.9 to 1.0 from step 10 (seed 0)


# --- validate -------------------------------------------------------------------------------------------------------

def test_the_generation_estimate_is_the_kv_cache_generate_holds(tiny_own_dir):
    from erniekit_lite.memory import Run, Shape, generation_bytes

    model = load_model(str(tiny_own_dir), attn_implementation="sdpa").eval()
    prompt, new = 5, 7
    with torch.no_grad():
        out = model.generate(input_ids=torch.full((3, prompt), 9), attention_mask=torch.ones(3, prompt, dtype=torch.long),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    shape = Shape.from_config(model.config)
    estimate = generation_bytes(shape, Run(tokens=1, scored=1, generate_sequences=3, generate_length=prompt + new), 4)
    logits = 3 * shape.vocab * (4 + 8)
    assert held <= estimate - logits < held * (prompt + new) / (prompt + new - 1) + 1  # the last token is never cached


def test_validate_plans_generation_and_a_broken_reward_fails_there(tiny_own_dir, tmp_path, capsys):
    train = {"num_generations": 4, "max_completion_length": 12, "per_device_train_batch_size": 8, "max_steps": 5}
    good = write_recipe(tmp_path / "good.yaml", tiny_own_dir, method="grpo", data={"train": [str(ARITH)], "max_length": 64},
                        rewards=[{"name": "exact_answer"}, {"function": str(ROOT / "recipes/data/grpo_rewards.py") + ":digits"}],
                        train=train)
    code, out, err = run_cli(capsys, "validate", good)
    assert code == 0, err
    assert "rewards: exact_answer x 1, digits x 1" in out
    assert "train: 24 prompts (24 with a reference answer)" in out
    assert "generation: KV cache and sampling logits of 8 sequences x 76 tokens (prompt + completion) at once" in out
    assert "batches: 96 completions per epoch (24 prompts x 4)" in out
    bad = write_recipe(tmp_path / "bad.yaml", tiny_own_dir, method="grpo", data={"train": [str(ARITH)]},
                       rewards=[{"function": "recipes/data/nowhere.py:f"}], train=train)
    code, out, err = run_cli(capsys, "validate", bad)
    assert code == 2 and err.strip().splitlines() == ["error: rewards.0.function: 'recipes/data/nowhere.py:f': no file "
                                                      "recipes/data/nowhere.py; expected 'package.module:function' or "
                                                      "'path/to/file.py:function'"]


@pytest.mark.slow
def test_packing_false_scores_with_trls_padded_path(tiny_own_dir, tmp_path, capsys, monkeypatch):
    from erniekit_lite.train.grpo_trainer import ErnieGRPOTrainer

    seen = []
    original = ErnieGRPOTrainer._get_per_token_logps_and_entropies
    monkeypatch.setattr(ErnieGRPOTrainer, "_get_per_token_logps_and_entropies",
                        lambda self, *a, **k: seen.append(self.packed_scoring) or original(self, *a, **k))
    recipe = write_recipe(tmp_path / "r.yaml", tiny_own_dir, method="grpo", lora={"r": 4, "alpha": 8},
                          data={"train": [str(ARITH)], "max_length": 64, "packing": False}, rewards=[{"name": "length", "args": {"target": 4}}],
                          train={"num_generations": 4, "max_completion_length": 8, "per_device_train_batch_size": 4, "beta": 0.1,
                                 "max_steps": 2, "logging_steps": 1, "save_strategy": "no", "activation_checkpointing": False})
    code, out, err = run_cli(capsys, "train", recipe)
    assert code == 0, err
    assert seen and not any(seen)  # reference and policy passes, all TRL's own
    assert "model: PeftModelForCausalLM attention=sdpa" in out
