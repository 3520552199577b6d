"""Recipe schema: overrides, unknown keys with suggestions, wrong types, YAML errors, and every shipped recipe."""

from __future__ import annotations

from pathlib import Path

import pytest

from erniekit_lite import recipe as recipes
from erniekit_lite.errors import RecipeError

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART_DPO = ROOT / "recipes" / "quickstart-dpo.yaml"
BASE = """\
model:
  path: some/model
data:
  train:
    - path: data.jsonl
  max_length: 512
output:
  dir: out
train:
  learning_rate: 1.0e-4
"""


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_defaults_and_overrides(tmp_path):
    r = recipes.load(write(tmp_path, BASE), ["train.learning_rate=2e-5", "model.path=./my-model", "data.packing=false", "lora.r=4"])
    assert r.model.path == "./my-model"
    assert r.train["learning_rate"] == 2e-5
    assert r.data.packing is False and r.data.overlong == "truncate" and r.method == "sft"
    assert r.lora is not None and r.lora.r == 4 and "gate_proj" in r.lora.targets
    assert r.data.train[0].format == "auto"


def test_shorthand_source_and_lora_true(tmp_path):
    r = recipes.load(write(tmp_path, BASE.replace("    - path: data.jsonl", "    - data.jsonl") + "lora: true\n"))
    assert r.data.train[0].path == "data.jsonl"
    assert r.lora.r == 8


@pytest.mark.parametrize(
    "text, expected",
    [
        (BASE.replace("learning_rate", "lerning_rate"), "r.yaml:10: unknown key 'lerning_rate' in train; did you mean 'learning_rate'?"),
        (BASE.replace("max_length", "max_lenght"), "r.yaml:6: unknown key 'max_lenght' in data; did you mean 'max_length'?"),
        (BASE + "modle: {}\n", "r.yaml:11: unknown key 'modle' in the recipe; did you mean 'model'?"),
        (BASE.replace("  path: some/model", "  path: some/model\n  dtyp: bfloat16"), "unknown key 'dtyp' in model; did you mean 'dtype'?"),
        (BASE.replace("max_length: 512", "max_length: lots"), "r.yaml:6: data.max_length: Input should be a valid integer"),
        (BASE.replace("model:\n  path: some/model\n", ""), "missing required key 'model'"),
        (BASE + "method: ppo\n", "method: 'ppo' is not one of sft, dpo, orpo, simpo, kto, rm, pt, grpo"),
        (BASE + "method: stf\n", "method: 'stf' is not one of sft, dpo, orpo, simpo, kto, rm, pt, grpo; did you mean 'sft'?"),
        (BASE.replace("    - path: data.jsonl", "    - path: data.jsonl\n      format: csv"), "data.train.0.format: 'csv' is not one of"),
        (BASE + "  max_length: 4\n", "train.max_length is set by the recipe; use data.max_length instead"),
        (BASE + "  output_dir: elsewhere\n", "use output.dir instead"),
        (BASE + "  max_steps: many\n", "r.yaml:11: train.max_steps: expected a number (got 'many')"),
        (BASE + "  max_steps: 2.5\n", "train.max_steps: expected a whole number"),
        (BASE + "  bf16: maybe\n", "train.bf16: expected true or false"),
        (BASE.replace("\ntrain:\n", "\nmethod: kto\ntrain:\n") + "  loss_type: kt0\n",
         "r.yaml:12: train.loss_type: expected one of kto, apo_zero_unpaired (got 'kt0')"),
        (BASE.replace("\ntrain:\n", "\nmethod: dpo\ntrain:\n") + "  loss_type: [sigmoid, sigmod]\n",
         "r.yaml:12: train.loss_type: expected one of sigmoid, hinge, ipo, exo_pair, nca_pair, robust, bco_pair, sppo_hard, aot, "
         "aot_unpaired, apo_zero, apo_down, discopop, sft, sigmoid_norm (got 'sigmod')"),
        (BASE + "  truncation_mode: keep_middle\n", "r.yaml:11: train.truncation_mode is TRL's, for its own data preparation or model loading; erniekit-lite does that itself for sft (use data.max_length)"),
        (BASE + "  save_strategy: sometimes\n", "r.yaml:11: train.save_strategy: expected one of no, steps, epoch, best (got 'sometimes')"),
    ],
)
def test_errors_name_file_line_key_and_fix(tmp_path, text, expected):
    with pytest.raises(RecipeError) as e:
        recipes.load(write(tmp_path, text))
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_yaml_syntax_error_has_line(tmp_path):
    with pytest.raises(RecipeError, match=r"r.yaml:4: YAML syntax error: .*\(while parsing a flow sequence at line 3\)"):
        recipes.load(write(tmp_path, "model:\n  path: x\n  bad: [1, 2\n"))


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        recipes.load(tmp_path / "nope.yaml")


def test_bad_override_syntax(tmp_path):
    with pytest.raises(RecipeError, match="expected dotted.key=value"):
        recipes.load(write(tmp_path, BASE), ["train.learning_rate"])


def test_eval_and_eval_split_conflict(tmp_path):
    with pytest.raises(RecipeError, match="either data.eval or data.eval_split"):
        recipes.load(write(tmp_path, BASE), ["data.eval_split=0.1", "data.eval=[x.jsonl]"])


def test_resolved_recipe_round_trips(tmp_path):
    r = recipes.load(write(tmp_path, BASE), ["lora.r=16"])
    again = recipes.from_dict(__import__("yaml").safe_load(r.to_yaml()))
    assert again == r


SHIPPED = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if "accelerate" not in p.parts)  # accelerate/: launcher configs


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_recipe_validates(path, tmp_path, monkeypatch):
    """Loaded from a working folder outside the repository (no ../shared beside it, no recipes/ in it), as a user of
    the installed package runs it: every data file it names is there (20 of 25 named ../shared/data before, the GRPO
    ones a GSM8K export the user had to make first)."""
    monkeypatch.chdir(tmp_path)
    r = recipes.load(path)
    assert r.output.dir
    files = [s.path for s in (*r.data.train, *r.data.eval)] + [f.partition(":")[0] for f in getattr(r.train, "reward_funcs", None) or []
                                                               if ".py:" in f]
    assert files and all(Path(f).is_file() for f in files), files
    assert "../shared" not in path.read_text(encoding="utf-8")


def test_the_shipped_train_fields_are_the_argument_classes():
    """erniekit_lite/train_fields.json (what checking `train:` reads) is the argument classes' fields (the project's,
    arguments.py; GRPO's from TRL), for the transformers and TRL installed: after an upgrade or a change of the
    classes, `python -c 'from erniekit_lite.recipe import write_train_fields; write_train_fields()'`. TRL's own keys
    for its data preparation are named as such."""
    import json

    shipped = json.loads(recipes.TRAIN_FIELDS.read_text())
    assert shipped["versions"] == recipes._field_versions()
    assert shipped["methods"] == json.loads(json.dumps(recipes.train_fields_from_classes()))
    assert list(shipped["methods"]["dpo"]["loss_type"]["choices"])[:2] == ["sigmoid", "hinge"]
    assert "dataset_text_field" not in shipped["methods"]["sft"] and "model_init_kwargs" in shipped["methods"]["grpo"]
    with pytest.raises(RecipeError, match=r"train.pad_token is TRL's, for its own data preparation or model loading; "
                                          r"erniekit-lite does that itself for dpo \(use the tokenizer\)"):
        recipes.load(QUICKSTART_DPO, ["train.pad_token=x"])


def test_the_argument_classes_keep_trls_defaults_and_choices():
    """A recipe that leaves a key out trains as it did on TRL 1.16's configs (the oracle here): every field the
    project's argument classes share with the TRL config of the method has TRL's default and choices, and the only
    fields of TRL's the project's lack are TRL's own data preparation and model loading keys (refused by name), the
    unsupported TR-DPO keys and those of TRL's data preparation the recipe's data section owns."""
    import dataclasses
    import warnings

    import trl

    from erniekit_lite.arguments import CLASSES

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.cpo import CPOConfig
        from trl.experimental.orpo import ORPOConfig
    trls = {"sft": trl.SFTConfig, "pt": trl.SFTConfig, "dpo": trl.DPOConfig, "kto": trl.KTOConfig, "orpo": ORPOConfig,
            "simpo": CPOConfig, "rm": trl.RewardConfig}
    never_read = {"dataset_text_field", "dataset_kwargs", "packing", "packing_strategy", "padding_free", "eval_packing",
                  "completion_only_loss", "assistant_only_loss", "max_length", "use_logits_to_keep"}

    def default(f):
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    for method, cls in CLASSES.items():
        ours = {f.name: f for f in dataclasses.fields(cls) if f.init}
        theirs = {f.name: f for f in dataclasses.fields(trls[method]) if f.init}
        for name in ours.keys() & theirs.keys():
            if (method, name) == ("kto", "train_sampling_strategy"):
                continue  # KTO's rows hold their KL twins: shuffled as any method's (the project's default all along)
            assert default(ours[name]) == default(theirs[name]), (method, name)
            listed = recipes.listed_choices(theirs[name])  # where TRL lists none, ours may (checked before the run)
            assert listed is None or recipes.listed_choices(ours[name]) == listed, (method, name)
        left = set(theirs) - set(ours) - set(recipes.TRLS_OWN_KEYS) - set(recipes.NOT_SUPPORTED) - never_read
        assert not left, (method, sorted(left))


def test_checking_a_recipe_imports_no_trl(tmp_path):
    """A launch's first process checks the recipe before starting the others: from the shipped fields, without
    importing TRL (and with it transformers and peft); the checks are the same: an unknown key, a wrong type, a value
    outside a field's choices."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from erniekit_lite import recipe\n"
        f"r = recipe.load({str(QUICKSTART_DPO)!r}, ['train.loss_type=[sigmoid]', 'train.beta=0.2'])\n"
        "assert r.train['beta'] == 0.2 and r.train['loss_type'] == ['sigmoid']\n"
        "for bad in ('train.lerning_rate=1', 'train.beta=high', 'train.loss_type=[sigmod]'):\n"
        "    try:\n"
        "        recipe.load(" + repr(str(QUICKSTART_DPO)) + ", [bad])\n"
        "    except Exception as e:\n"
        "        print(e)\n"
        "print(sorted(m for m in ('trl', 'transformers', 'peft', 'torch') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "unknown key 'lerning_rate' in train; did you mean 'learning_rate'?" in lines[0]
    assert "beta" in lines[1] and "train.loss_type: expected one of sigmoid" in lines[2]
    assert lines[-1] == "[]"


@pytest.mark.parametrize("override, expected", [
    ("method=sfft", "override 'method=sfft': method: 'sfft' is not one of sft, dpo, orpo, simpo, kto, rm, pt, grpo; did you mean 'sft'?"),
    ("train.learning_rate=fast", "override 'train.learning_rate=fast': train.learning_rate: expected a number (got 'fast')"),
    ("train.max_stepz=10", "override 'train.max_stepz=10': unknown key 'max_stepz' in train; did you mean 'max_steps'?"),
    ("data.train=[{path: x.jsonl, formt: auto}]", "override 'data.train=[{path: x.jsonl, formt: auto}]': unknown key 'formt'"),
])
def test_a_bad_override_is_named_as_typed_not_blamed_on_a_file_line(tmp_path, override, expected):
    """These were reported at the file line of the key the override replaced (or at the section's line)."""
    with pytest.raises(RecipeError) as e:
        recipes.load(write(tmp_path, BASE), [override])
    assert str(e.value).startswith(expected), str(e.value)


def test_a_misspelt_section_says_did_you_mean_first_and_a_recipe_name_too(tmp_path):
    with pytest.raises(RecipeError) as e:
        recipes.load(write(tmp_path, BASE.replace("output:", "ouput:")))
    assert str(e.value) == (f"{tmp_path / 'r.yaml'}:7: unknown key 'ouput' in the recipe; did you mean 'output'? (and "
                            f"{tmp_path / 'r.yaml'}: missing required key 'output')")  # the second named too
    with pytest.raises(RecipeError) as e:
        recipes.load("quickstrat")
    assert str(e.value) == "quickstrat: recipe file not found (did you mean 'quickstart'?)"
    # a part of a name lists the recipes that have it; a name like none says where the names are
    with pytest.raises(RecipeError) as e:
        recipes.load("sft-lora-32")
    assert str(e.value) == ("sft-lora-32: recipe file not found (shipped recipes with 'sft-lora-32' in their name: "
                            "ernie-4.5-21b-a3b-thinking/sft-lora-32k)")
    with pytest.raises(RecipeError) as e:
        recipes.load("banana")
    assert str(e.value) == ("banana: recipe file not found (nor a shipped recipe's name: `erniekit-lite recipes` lists "
                            "them, e.g. quickstart, ernie-4.5-0.3b/sft-lora)")


def test_the_recipes_list_gives_each_shipped_recipe_a_whole_sentence(capsys):
    """`erniekit-lite recipes` printed each recipe's first comment line, cut mid-sentence ("... follow ERNIEKit's
    official 0.3B LoRA recipe")."""
    from erniekit_lite import shipped
    from erniekit_lite.cli import main

    assert main(["recipes"]) == 0
    listed = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert sorted(listed) == shipped.names()
    for name, summary in listed.items():
        assert summary.endswith(".") and summary.count("(") == summary.count(")"), (name, summary)
    assert listed["ernie-4.5-0.3b/sft-lora"] == "LoRA fine-tuning of ERNIE-4.5-0.3B-PT."


def test_the_recipes_list_into_a_pipe_that_closes_early_ends_quietly():
    """`erniekit-lite recipes | head -1` printed a BrokenPipeError traceback."""
    import subprocess
    import sys

    listing = subprocess.Popen([sys.executable, "-m", "erniekit_lite", "recipes"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    listing.stdout.close()  # the reader is gone before the list is written, as `head` is once it has its line
    err = listing.stderr.read().decode()
    assert listing.wait(timeout=60) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_max_steps_and_loggers_are_refused_before_anything_loads(tmp_path):
    """`train.max_steps: -5` trained the epochs silently (the Trainer reads any value below 1 as "use epochs"); a
    mistyped or missing logger passed validate and `train` died in a 36-line traceback. Each is one line naming the
    key, from the recipe check that validate and train share."""
    for override, says in (
        ("train.max_steps=-5", "train.max_steps: expected a whole number of optimizer steps, at least 1, or -1 to train "
                               "train.num_train_epochs (got -5)"),
        ("train.report_to=tensorbord", "train.report_to: unknown logger 'tensorbord'; did you mean 'tensorboard'?"),
        ("train.report_to=[none, xyz]", "train.report_to: unknown logger 'xyz'; expected one of: azure_ml,"),
    ):
        with pytest.raises(RecipeError) as e:
            recipes.load("quickstart", [override])
        assert says in str(e.value), str(e.value)
    from transformers.integrations.integration_utils import get_available_reporting_integrations

    if "tensorboard" not in get_available_reporting_integrations():  # as on the test machines
        with pytest.raises(RecipeError, match="train.report_to: tensorboard is not installed here"):
            recipes.load("quickstart", ["train.report_to=tensorboard"])
    assert recipes.load("quickstart", ["train.max_steps=-1", "train.report_to=none"]).train["max_steps"] == -1
    # transformers' enum fields: the key's file and line, and a "did you mean" (the config's own check named neither)
    path = tmp_path / "r.yaml"
    from erniekit_lite import shipped

    path.write_text((shipped.RECIPES / "quickstart.yaml").read_text().replace("lr_scheduler_type: cosine", "lr_scheduler_type: cosin"))
    line = path.read_text().splitlines().index(next(l for l in path.read_text().splitlines() if "lr_scheduler_type: cosin" in l)) + 1
    with pytest.raises(RecipeError) as e:
        recipes.load(path)
    assert str(e.value).startswith(f"{path}:{line}: train.lr_scheduler_type: expected one of linear, cosine, ")
    assert str(e.value).endswith("(got 'cosin'); did you mean 'cosine'?")
    for override, says in (("train.optim=adamw_tourch", "did you mean 'adamw_torch'?"), ("train.save_strategy=stepz", "did you mean 'steps'?")):
        with pytest.raises(RecipeError, match=says):
            recipes.load("quickstart", [override])
    assert recipes.load("quickstart", ["train.save_strategy=no"]).train["save_strategy"] in ("no", False)
