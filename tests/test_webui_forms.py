"""Web UI form <-> YAML: every shipped recipe survives the round trip; edits land in the YAML; mistakes are the
recipe module's one-line messages."""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import gradio as gr
import pytest
import yaml

from erniekit_lite import recipe as recipes
from erniekit_lite.errors import RecipeError
from erniekit_lite.webui import forms
from erniekit_lite.webui.paths import recipe_files

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = (ROOT / "recipes" / "quickstart.yaml").read_text(encoding="utf-8")


def field_index(key: str, method: str | None = None) -> int:
    """The form's position of `key`'s field: the one `method` shows, where methods have their own (train.loss_type)."""
    return next(i for i, f in enumerate(forms.FIELDS) if f.key == key and (method is None or forms.shown(f, method)))


@pytest.mark.parametrize("name", recipe_files(ROOT))
def test_every_shipped_recipe_round_trips(name):
    original = recipes.load(ROOT / name)
    form = forms.values(forms.parse((ROOT / name).read_text(encoding="utf-8"), Path(name).name))
    rewritten = forms.apply(original, form)
    assert rewritten == original  # the form changes nothing it shows unchanged
    again = forms.parse(rewritten.to_yaml(), Path(name).name)
    assert again == original and forms.values(again) == form


def test_form_edits_are_written_to_the_yaml():
    form = forms.values(forms.parse(QUICKSTART, "quickstart.yaml"))
    form[field_index("train.max_steps")] = 5
    form[field_index("train.logging_steps")] = 1
    form[field_index("lora")] = True
    form[field_index("lora.r")] = 4
    form[field_index("train.num_train_epochs")] = None  # blank: not set
    form[field_index("data.train")] = "recipes/data/identity.jsonl\n\n  other.jsonl  \n"
    text = forms.apply(forms.parse(QUICKSTART, "quickstart.yaml"), form).to_yaml()
    recipe = forms.parse(text, "quickstart.yaml")
    assert recipe.train["max_steps"] == 5 and recipe.train["logging_steps"] == 1
    assert "num_train_epochs" not in recipe.train
    assert recipe.lora is not None and recipe.lora.r == 4 and recipe.lora.alpha == 16
    assert [s.path for s in recipe.data.train] == ["recipes/data/identity.jsonl", "other.jsonl"]
    assert recipe.output.sample_prompts == ["Who are you?", "What is your name?", "你是谁？"]  # keys not in the form stay

    form[field_index("lora")] = False
    assert forms.apply(recipe, form).lora is None


def test_mixed_source_formats_are_left_as_they_are():
    recipe = recipes.from_dict({
        "model": {"path": "m"}, "output": {"dir": "o"},
        "data": {"train": [{"path": "a.jsonl", "format": "alpaca", "max_samples": 3}, {"path": "b.jsonl", "format": "sharegpt"}]},
    })
    form = forms.values(recipe)
    assert form[field_index("data.format")] is None
    assert forms.apply(recipe, form) == recipe
    form[field_index("data.format")] = "messages"
    sources = forms.apply(recipe, form).data.train
    assert [(s.format, s.max_samples) for s in sources] == [("messages", 3), ("messages", None)]


def test_yaml_mistakes_are_the_recipe_modules_messages(tmp_path):
    bad = QUICKSTART.replace("learning_rate:", "lerning_rate:")
    (tmp_path / "quickstart.yaml").write_text(bad, encoding="utf-8")
    with pytest.raises(RecipeError) as from_file:
        recipes.load(tmp_path / "quickstart.yaml")
    with pytest.raises(RecipeError) as from_editor:
        forms.parse(bad, "quickstart.yaml")
    assert str(from_editor.value) == str(from_file.value).replace(f"{tmp_path}/", "")
    assert str(from_editor.value) == "quickstart.yaml:17: unknown key 'lerning_rate' in train; did you mean 'learning_rate'?"

    with pytest.raises(RecipeError, match=r"^quickstart\.yaml:\d+: YAML syntax error: "):
        forms.parse("model:\n  path: [unclosed\n", "quickstart.yaml")


def test_form_mistakes_name_the_key():
    recipe = forms.parse(QUICKSTART, "quickstart.yaml")
    form = forms.values(recipe)
    form[field_index("data.max_length")] = 5
    with pytest.raises(RecipeError, match=r"^form: data\.max_length: Input should be greater than or equal to 16 \(got 5\)$"):
        forms.apply(recipe, form)
    form = forms.values(recipe)
    form[field_index("data.train")] = "  \n"
    with pytest.raises(RecipeError, match=r"^form: data\.train: "):
        forms.apply(recipe, form)


def test_labels_carry_the_keys_own_help():
    helps = {f.key: forms.help_text(f) for f in forms.FIELDS}
    assert helps["data.max_length"] == recipes.DataSection.model_fields["max_length"].description
    assert helps["train.learning_rate"] == "The initial learning rate for AdamW."  # TRL's help, first sentence
    assert all(helps.values())


# Each method's own fields: shown for that method only, in sync with the YAML, and dropped with the method.

OWN_FIELDS = {
    "sft": {"train.router_z_loss_coef", "train.router_orthogonal_loss_coef"},  # erniekit-lite's own (recipe.OWN_TRAIN_KEYS)
    "pt": {"train.router_z_loss_coef", "train.router_orthogonal_loss_coef"},
    "dpo": {"train.beta", "train.loss_type", "train.loss_weights"},
    "orpo": {"train.beta"},
    "simpo": {"train.beta", "train.simpo_gamma", "train.cpo_alpha"},
    "kto": {"train.beta", "train.loss_type", "train.desirable_weight", "train.undesirable_weight"},
    "rm": {"train.center_rewards_coefficient"},
    "grpo": {"train.beta", "train.num_generations", "train.max_completion_length", "train.temperature", "rewards"},
}
# A recipe of each method with its own keys set (values unlike TRL's defaults), and the form's edit of them
OWN_VALUES = {
    "sft": ({"router_z_loss_coef": 0.001}, {"train.router_z_loss_coef": 0.002}),
    "pt": ({}, {}),
    "dpo": ({"beta": 0.25, "loss_type": ["sigmoid", "sft"], "loss_weights": [0.8, 0.2]},
            {"train.beta": 0.5, "train.loss_type": ["ipo"], "train.loss_weights": None}),
    "orpo": ({"beta": 0.3}, {"train.beta": 0.05}),
    "simpo": ({"beta": 2.5, "simpo_gamma": 1.25, "cpo_alpha": 0.2}, {"train.simpo_gamma": 0.75, "train.cpo_alpha": None}),
    "kto": ({"beta": 0.2, "desirable_weight": 1.5, "undesirable_weight": 2.0, "loss_type": "kto"},
            {"train.desirable_weight": 1.0, "train.undesirable_weight": 1.25, "train.loss_type": "apo_zero_unpaired"}),
    "rm": ({"center_rewards_coefficient": 0.01}, {"train.center_rewards_coefficient": 0.02}),
    "grpo": ({"beta": 0.04, "num_generations": 4, "max_completion_length": 32, "temperature": 0.7},
             {"train.num_generations": 2, "train.temperature": None}),
}
COMMON_TRAIN = {"learning_rate": 0.001, "max_steps": 7, "logging_steps": 1}


def method_yaml(method: str, train: dict) -> str:
    data = {"pt": "recipes/data/pt_demo.jsonl", "kto": "recipes/data/identity_kto.jsonl", "sft": "recipes/data/identity.jsonl",
            "grpo": "recipes/data/grpo_arith.jsonl"}.get(method, "recipes/data/identity_dpo.jsonl")
    rewards = {"rewards": [{"name": "exact_answer"}]} if method == "grpo" else {}
    return yaml.safe_dump({"model": {"path": "runs/tiny-ernie"}, "method": method, "data": {"train": [data]}, **rewards,
                           "lora": {"r": 4}, "output": {"dir": f"runs/{method}"}, "train": {**COMMON_TRAIN, **train}},
                          sort_keys=False)


@pytest.mark.parametrize("method", list(OWN_FIELDS))
def test_the_form_shows_the_methods_own_fields_only(method):
    from erniekit_lite.webui.train_tab import fill

    updates = fill(forms.parse(method_yaml(method, OWN_VALUES[method][0]), "r.yaml"))
    *fields, note = updates
    visible = {f.key for f, u in zip(forms.FIELDS, fields) if u["visible"]}
    common = {f.key for f in forms.FIELDS if not f.methods}
    assert visible == common | OWN_FIELDS[method]
    beta = fields[field_index("train.beta")]
    if method == "orpo":  # the help is the method's TRL config's: ORPO's beta is the paper's lambda
        assert beta["info"] == "Parameter controlling the relative ratio loss weight in the ORPO loss. In the paper, it is denoted by λ."
    elif method == "dpo":
        assert beta["info"] == "Parameter controlling the deviation from the reference model."
        assert fields[field_index("train.loss_weights")]["info"] == "List of loss weights for multi-loss combinations."
    elif method == "kto":  # its own loss_type field, with KTOConfig's help (DPO's is hidden)
        assert fields[field_index("train.loss_type", "kto")]["info"] == "Type of loss to use."
    elif method == "rm":  # the first sentence: not cut at "Eq. 2"
        assert fields[field_index("train.center_rewards_coefficient")]["info"] == (
            "Coefficient to incentivize the reward model to output mean-zero rewards (proposed by [this paper]"
            "(https://huggingface.co/papers/2312.09244), Eq. 2).")
    if method == "kto":  # no recipe key names KTO's label: the note says which record fields hold it
        assert note == {"__type__": "update", "visible": True, "value": (
            "KTO reads each record's label from its `label` or `kto_tag` field: true for a desirable completion, false "
            "for an undesirable one (no recipe key: the field names are fixed).")}
    elif method == "grpo":  # what the form leaves to the YAML: own reward functions, reward models, weights
        assert note["visible"] is True and "`function: file.py:name`" in note["value"] and "`model: RUN`" in note["value"]
    elif method != "simpo":
        assert note["visible"] is False


@pytest.mark.parametrize("method", list(OWN_FIELDS))
def test_method_fields_round_trip_between_yaml_and_form(method):
    own, edits = OWN_VALUES[method]
    recipe = forms.parse(method_yaml(method, own), "r.yaml")
    form = forms.values(recipe)
    shown = {f.key: v for f, v in zip(forms.FIELDS, form) if f.methods and v is not None}
    rewards = {"rewards": ["exact_answer"]} if method == "grpo" else {}
    as_form = {"loss_weights": lambda weights: ", ".join(map(str, weights))}  # a text of numbers
    assert shown == {**{f"train.{k}": as_form.get(k, lambda v: v)(v) for k, v in own.items()}, **rewards}
    assert all(v is None for f, v in zip(forms.FIELDS, form) if f.methods and not forms.shown(f, method))
    assert forms.apply(recipe, form) == recipe  # unedited: unchanged

    for key, value in edits.items():
        form[field_index(key, method)] = value
    text = forms.apply(recipe, form).to_yaml()
    again = forms.parse(text, "r.yaml")
    expected = {**COMMON_TRAIN, **own, **{k.removeprefix("train."): v for k, v in edits.items()}}
    assert again.train == {k: v for k, v in expected.items() if v is not None}
    assert again.method == method and forms.values(again) == form


def test_a_single_loss_type_stays_as_written():
    recipe = forms.parse(method_yaml("dpo", {"loss_type": "sigmoid"}), "r.yaml")
    form = forms.values(recipe)
    assert form[field_index("train.loss_type")] == ["sigmoid"]
    assert forms.apply(recipe, form).train["loss_type"] == "sigmoid"
    form[field_index("train.loss_type")] = []  # none chosen: TRL's default
    assert "loss_type" not in forms.apply(recipe, form).train


@pytest.mark.parametrize(("old", "new"), list(itertools.permutations(OWN_FIELDS, 2)))
def test_switching_the_method_in_the_form_gives_a_recipe_that_trains(old, new, tmp_path):
    """Every switch gives a recipe that validates and makes its TRL config; the old method's own keys are gone
    (between sft and pt, one config class, all stay)."""
    from erniekit_lite.trainer_args import training_args

    own = {"router_aux_loss_coef": 0.001, "loss_type": "dft"} if old in ("sft", "pt") else OWN_VALUES[old][0]
    recipe = forms.parse(method_yaml(old, own), "r.yaml")
    form = forms.values(recipe)
    form[field_index("method")] = new
    switched = forms.apply(recipe, form)
    assert switched.train == ({**COMMON_TRAIN, **own} if {old, new} == {"sft", "pt"} else COMMON_TRAIN)
    # rewards: is grpo's alone; a switch to grpo starts with the reward that checks answers
    assert [e.name for e in switched.rewards] == ["exact_answer"] if new == "grpo" else switched.rewards is None
    assert forms.parse(switched.to_yaml(), "r.yaml") == switched
    args = training_args(switched, tmp_path)
    assert (args.learning_rate, args.max_steps, args.logging_steps) == (0.001, 7, 1)
    if new in ("dpo", "kto", "orpo", "simpo"):
        assert args.beta == 0.1  # TRL's default, not the old method's beta
    if new == "grpo":
        assert (args.beta, args.num_generations) == (0.0, 8)  # GRPOConfig's defaults


def test_switching_the_method_says_what_it_removed_and_refills_the_form():
    from erniekit_lite.webui.train_tab import edit

    text = method_yaml("dpo", {"beta": 0.25, "loss_type": ["ipo"]})
    form = forms.values(forms.parse(text, "r.yaml"))
    form[field_index("method")] = "simpo"  # the form still holds DPO's beta and loss_type: neither is written
    new_text, status, *updates = edit(text, "r.yaml", form)
    simpo = forms.parse(new_text, "r.yaml")
    assert simpo.method == "simpo" and simpo.train == COMMON_TRAIN
    assert status == "method simpo: removed train.beta, train.loss_type (dpo's own settings; simpo's start from TRL's defaults)"
    *fields, note = updates
    assert {f.key: (u["visible"], u["value"]) for f, u in zip(forms.FIELDS, fields) if f.methods} == {
        "train.beta": (True, None), "train.loss_type": (False, None), "train.loss_weights": (False, None),
        "train.simpo_gamma": (True, None), "train.cpo_alpha": (True, None), "train.desirable_weight": (False, None),
        "train.undesirable_weight": (False, None), "train.center_rewards_coefficient": (False, None),
        "train.router_z_loss_coef": (False, None), "train.router_orthogonal_loss_coef": (False, None),
        "train.num_generations": (False, None), "train.max_completion_length": (False, None),
        "train.temperature": (False, None), "rewards": (False, None)}
    assert note["value"] == "SimPO is TRL's CPO with `loss_type: simpo`, set for you: leave `train.loss_type` out."

    form = forms.values(simpo)
    form[field_index("train.simpo_gamma")] = 0.5  # an edit within the method: the form is not refilled
    new_text, status, *updates = edit(simpo.to_yaml(), "r.yaml", form)
    assert forms.parse(new_text, "r.yaml").train == {**COMMON_TRAIN, "simpo_gamma": 0.5} and status == ""
    assert updates == [gr.skip()] * len(updates)
    assert edit(new_text, "r.yaml", forms.values(forms.parse(new_text, "r.yaml")))[:2] == [gr.skip(), gr.skip()]


def test_the_rewards_field_edits_the_built_ins_and_keeps_the_rest():
    """The form names built-in rewards; those kept keep their weight and args, new ones come with weight 1, and
    function and reward-model entries stay as the YAML has them."""
    from erniekit_lite.webui.train_tab import edit

    text = method_yaml("grpo", {}).replace("- name: exact_answer", "- name: exact_answer\n  weight: 2.0\n- function: "
                                           "recipes/data/grpo_rewards.py:digits\n  weight: 0.5")
    recipe = forms.parse(text, "r.yaml")
    form = forms.values(recipe)
    assert form[field_index("rewards")] == ["exact_answer"]
    form[field_index("rewards")] = ["exact_answer", "length"]
    rewards = [e.model_dump(exclude_defaults=True) for e in forms.apply(recipe, form).rewards]
    assert rewards == [{"name": "exact_answer", "weight": 2.0}, {"function": "recipes/data/grpo_rewards.py:digits", "weight": 0.5},
                       {"name": "length"}]
    form[field_index("rewards")] = []
    assert [e.function for e in forms.apply(recipe, form).rewards] == ["recipes/data/grpo_rewards.py:digits"]
    alone = forms.parse(method_yaml("grpo", {}), "r.yaml")
    form = forms.values(alone)
    form[field_index("rewards")] = []  # no reward left: the recipe's own one-line error
    with pytest.raises(RecipeError, match="method: grpo needs rewards"):
        forms.apply(alone, form)

    text = method_yaml("dpo", {"beta": 0.25})
    form = forms.values(forms.parse(text, "r.yaml"))
    form[field_index("method")] = "grpo"
    new_text, status, *_ = edit(text, "r.yaml", form)
    assert forms.parse(new_text, "r.yaml").rewards[0].name == "exact_answer"
    assert status == ("method grpo: removed train.beta (dpo's own settings; grpo's start from TRL's defaults); rewards: "
                      "exact_answer to start with (choose the rewards below)")
    form = forms.values(forms.parse(new_text, "r.yaml"))
    form[field_index("method")] = "sft"
    new_text, status, *_ = edit(new_text, "r.yaml", form)
    assert forms.parse(new_text, "r.yaml").rewards is None
    assert status == "method sft: removed rewards (grpo's own settings; sft's start from TRL's defaults)"


def test_the_form_never_writes_a_field_its_method_hides():
    recipe = forms.parse(method_yaml("kto", OWN_VALUES["kto"][0]), "r.yaml")
    form = forms.values(recipe)
    form[field_index("train.simpo_gamma")] = 3.0  # a stale value in a hidden field
    form[field_index("train.loss_type")] = ["ipo"]
    assert forms.apply(recipe, form) == recipe


@contextlib.contextmanager
def served_app(tmp_path: Path, monkeypatch, exposed: bool = False, llama_cpp: str | None = None):
    """The web UI served from a copy of the recipes on a free port, and a gradio_client on it (as a page calls it);
    `exposed`: built as for a UI others reach (--host other than loopback, --share, --auth), served on loopback here;
    `llama_cpp`: the server's own llama.cpp folder (`webui --llama-cpp`)."""
    import shutil
    import socket

    from gradio_client import Client

    from erniekit_lite.webui import app

    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    monkeypatch.chdir(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo = app.build(exposed, llama_cpp)
    demo.queue().launch(server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield Client(f"http://127.0.0.1:{port}/", verbose=False)
    finally:
        demo.close()


def form_endpoints(client) -> list[str]:
    """The form fields' edit endpoints, one per field in forms.FIELDS' order."""
    names = [e for e in client.view_api(print_info=False, return_format="dict")["named_endpoints"] if e.startswith("/form_edited")]
    assert len(names) == len(forms.FIELDS)
    return names


def test_the_served_app_swaps_the_method_fields(tmp_path, monkeypatch):
    """Through a running server (gradio_client, as a page calls it): the DPO quick start fills DPO's fields, and
    choosing kto in the form rewrites the YAML without them and shows KTO's fields and its label note."""
    with served_app(tmp_path, monkeypatch) as client:
        # outputs as the client gets them: [text, *fields, note, status] (the file-name state is not sent)
        text, *fields, note, status = client.predict("recipes/quickstart-dpo.yaml", api_name="/choose")
        assert status == "quickstart-dpo.yaml: loaded"
        own = [(f.key, u["value"]) for f, u in zip(forms.FIELDS, fields) if f.methods and u["visible"]]
        assert own == [("train.beta", 0.1), ("train.loss_type", ["sigmoid"]), ("train.loss_weights", None)]
        new_text, status, *fields, note = client.predict("kto", api_name=form_endpoints(client)[field_index("method")])
        # and back in the YAML editor: simpo, written by hand, refills the form with SimPO's fields
        *by_yaml, yaml_note, yaml_status = client.predict(
            new_text.replace("method: kto", "method: simpo"), api_name="/yaml_edited")
        # Validate through the page's handler: a recipe the recipe module refuses, said with the key's line
        pissa = client.predict(text.replace("  dropout: 0.0\n", "  dropout: 0.0\n  init: pissa\n"), api_name="/validate")
    assert status == "method kto: removed train.beta, train.loss_type (dpo's own settings; kto's start from TRL's defaults)"
    kto = forms.parse(new_text, "quickstart-dpo.yaml")
    assert kto.method == "kto" and "beta" not in kto.train and kto.train["learning_rate"] == 0.005
    assert [(f.key, f.kind, u["value"]) for f, u in zip(forms.FIELDS, fields) if f.methods and u["visible"]] == [
        ("train.beta", "number", None), ("train.loss_type", "choice", None), ("train.desirable_weight", "number", None),
        ("train.undesirable_weight", "number", None)]
    assert note["visible"] is True and "`label` or `kto_tag`" in note["value"]
    assert yaml_status == "" and yaml_note["value"].startswith("SimPO is TRL's CPO")
    line = text.replace("  dropout: 0.0\n", "  dropout: 0.0\n  init: pissa\n").splitlines().index("  init: pissa") + 1
    assert pissa == {"__type__": "update", "visible": True, "value": f"error: quickstart-dpo.yaml:{line}: {PISSA_FOR_DPO}"}
    assert [f.key for f, u in zip(forms.FIELDS, by_yaml) if f.methods and u["visible"]] == [
        "train.beta", "train.simpo_gamma", "train.cpo_alpha"]


# LoRA variants (lora.use_rslora, use_dora, init, plus_lr_ratio), KTO's loss_type and DPO's loss_weights

VARIANT_KEYS = ("lora.use_rslora", "lora.use_dora", "lora.init", "lora.plus_lr_ratio")


def variants(form: list) -> tuple:
    return tuple(form[field_index(k)] for k in VARIANT_KEYS)


def test_lora_variant_fields_round_trip_exactly():
    text = method_yaml("sft", {}).replace("lora:\n  r: 4\n", "lora:\n  r: 4\n  use_rslora: true\n  use_dora: true\n"
                                          "  init: olora\n  plus_lr_ratio: 12.5\n")
    recipe = forms.parse(text, "r.yaml")
    form = forms.values(recipe)
    assert variants(form) == (True, True, "olora", 12.5)
    assert forms.apply(recipe, form) == recipe  # unedited: unchanged

    form[field_index("lora.use_rslora")] = False
    form[field_index("lora.init")] = "pissa_niter_4"  # not offered in the list: typed (or from the YAML)
    form[field_index("lora.plus_lr_ratio")] = 16
    again = forms.parse(forms.apply(recipe, form).to_yaml(), "r.yaml")
    assert again.lora.model_dump() == {**recipe.lora.model_dump(), "use_rslora": False, "init": "pissa_niter_4",
                                       "plus_lr_ratio": 16}
    assert variants(forms.values(again)) == (False, True, "pissa_niter_4", 16)

    form = forms.values(again)
    form[field_index("lora.init")] = "true"  # the form's name for YAML's `init: true`
    form[field_index("lora.use_dora")] = False
    written = forms.apply(again, form).to_yaml()
    assert "  init: true\n" in written and "  use_dora: false\n" in written
    assert forms.parse(written, "r.yaml").lora.init is True


def test_unset_new_keys_stay_unset():
    """A recipe without them shows the recipe's defaults (LoRA) or blanks (TRL's keys), and an edit elsewhere keeps
    them so: the lora: section equals one that never named them, and train: gets no loss_type or loss_weights."""
    for method in ("sft", "dpo", "kto"):
        recipe = forms.parse(method_yaml(method, {}), "r.yaml")
        form = forms.values(recipe)
        assert variants(form) == (False, False, "true", None)
        assert [v for f, v in zip(forms.FIELDS, form) if f.key.startswith("train.loss")] == [None, None, None]  # blank
        form[field_index("train.max_steps")] = 9
        edited = forms.parse(forms.apply(recipe, form).to_yaml(), "r.yaml")
        assert edited.lora == recipes.LoraSection(r=4)
        assert edited.lora.model_dump() == {"r": 4, "alpha": 16.0, "dropout": 0.0, "targets": recipes.DEFAULT_LORA_TARGETS,
                                            "routed_experts": True, "vision": False, "expert_r": None, "expert_compute": "split", "use_rslora": False,
                                            "use_dora": False, "init": True, "plus_lr_ratio": None}
        assert edited.train == {**COMMON_TRAIN, "max_steps": 9}


def test_a_lora_off_form_writes_no_lora_keys():
    recipe = forms.parse(method_yaml("sft", {}).replace("lora:\n  r: 4\n", ""), "r.yaml")
    assert recipe.lora is None
    form = forms.values(recipe)
    assert form[field_index("lora")] is False and variants(form) == (False, False, "true", None)  # defaults, shown
    for key, value in zip(VARIANT_KEYS, (True, True, "pissa", 4.0)):  # set while LoRA is off
        form[field_index(key)] = value
    off = forms.apply(recipe, form)
    assert off.lora is None and off == recipe
    written = off.to_yaml()
    assert "lora: null\n" in written and not any(k in written for k in ("use_rslora", "use_dora", "init:", "plus_lr_ratio"))

    text = method_yaml("sft", {}).replace("lora:\n  r: 4\n", "lora:\n  r: 4\n  use_dora: true\n  plus_lr_ratio: 8\n")
    on = forms.parse(text, "r.yaml")
    assert on.lora.use_dora is True and on.lora.plus_lr_ratio == 8
    form = forms.values(on)
    form[field_index("lora")] = False  # switched off: the section goes, variants and all
    assert forms.apply(on, form).lora is None


def test_kto_loss_type_is_one_of_trls_and_round_trips():
    kto_field = forms.FIELDS[field_index("train.loss_type", "kto")]
    assert (kto_field.kind, kto_field.choices, kto_field.methods) == ("choice", ("kto", "apo_zero_unpaired"), ("kto",))
    assert forms.FIELDS[field_index("train.loss_type", "dpo")].choices[:3] == ("sigmoid", "hinge", "ipo")
    recipe = forms.parse(method_yaml("kto", {"loss_type": "apo_zero_unpaired"}), "r.yaml")
    form = forms.values(recipe)
    assert form[field_index("train.loss_type", "kto")] == "apo_zero_unpaired"
    assert form[field_index("train.loss_type", "dpo")] is None  # DPO's field: hidden, empty
    assert forms.apply(recipe, form) == recipe
    form[field_index("train.loss_type", "kto")] = "kto"
    assert forms.parse(forms.apply(recipe, form).to_yaml(), "r.yaml").train == {**COMMON_TRAIN, "loss_type": "kto"}
    form[field_index("train.loss_type", "kto")] = None  # blank: TRL's default
    assert forms.apply(recipe, form).train == COMMON_TRAIN


def test_dpo_loss_weights_are_a_list_of_numbers():
    recipe = forms.parse(method_yaml("dpo", {"loss_type": ["sigmoid", "sft"], "loss_weights": [1, 0.25]}), "r.yaml")
    form = forms.values(recipe)
    assert form[field_index("train.loss_weights")] == "1, 0.25"
    assert forms.apply(recipe, form) == recipe
    for typed, written in (("0.8, 0.2", [0.8, 0.2]), ("  2 0.5e-1 ", [2.0, 0.05]), ("3", [3.0])):
        form[field_index("train.loss_weights")] = typed
        again = forms.parse(forms.apply(recipe, form).to_yaml(), "r.yaml")
        assert again.train["loss_weights"] == written and again.train["loss_type"] == ["sigmoid", "sft"]
    form[field_index("train.loss_weights")] = " "  # blank: TRL's equal weights
    assert "loss_weights" not in forms.apply(recipe, form).train
    form[field_index("train.loss_weights")] = "0.8, heavy"
    with pytest.raises(RecipeError) as e:
        forms.apply(recipe, form)
    assert str(e.value) == "form: train.loss_weights: expected numbers separated by commas (got '0.8, heavy')"


@pytest.mark.parametrize(("old", "own", "new", "status"), [
    ("kto", {"loss_type": "apo_zero_unpaired"}, "sft",
     "method sft: removed train.loss_type (kto's own settings; sft's start from TRL's defaults)"),
    ("kto", {"loss_type": "apo_zero_unpaired"}, "dpo",
     "method dpo: removed train.loss_type (kto's own settings; dpo's start from TRL's defaults)"),
    ("dpo", {"loss_type": ["sigmoid", "sft"], "loss_weights": [0.8, 0.2]}, "kto",
     "method kto: removed train.loss_type, train.loss_weights (dpo's own settings; kto's start from TRL's defaults)"),
    ("dpo", {"loss_type": ["sigmoid", "sft"], "loss_weights": [0.8, 0.2]}, "orpo",
     "method orpo: removed train.loss_type, train.loss_weights (dpo's own settings; orpo's start from TRL's defaults)"),
])
def test_switching_away_drops_the_loss_keys_and_says_so(old, own, new, status):
    from erniekit_lite.webui.train_tab import edit

    text = method_yaml(old, own)
    form = forms.values(forms.parse(text, "r.yaml"))
    form[field_index("method")] = new
    new_text, said, *updates = edit(text, "r.yaml", form)
    assert said == status
    assert forms.parse(new_text, "r.yaml").train == COMMON_TRAIN
    *fields, _ = updates
    assert [(f.key, u["value"]) for f, u in zip(forms.FIELDS, fields) if f.key.startswith("train.loss") and u["visible"]] == (
        [("train.loss_type", None), ("train.loss_weights", None)] if new == "dpo" else
        [("train.loss_type", None)] if new == "kto" else [])


PISSA_FOR_DPO = ("lora.init: pissa moves part of each base weight into the adapter, and DPO's reference is the base with "
                 "the adapter disabled, which would then be the changed base; use lora.init true, gaussian, orthogonal or "
                 "mica for dpo")


def test_pissa_for_dpo_is_refused_on_the_form_edit_with_the_recipes_line(tmp_path):
    """The recipe refuses it (as `validate` and `train` do), so the form says it on the edit, pointed at the key."""
    from erniekit_lite.webui.train_tab import edit, start_job, validate_recipe

    text = method_yaml("dpo", {})
    form = forms.values(forms.parse(text, "r.yaml"))
    form[field_index("lora.init")] = "pissa"
    assert edit(text, "r.yaml", form)[:2] == [gr.skip(), f"error: form: {PISSA_FOR_DPO}"]  # the YAML stays as it was
    with pytest.raises(RecipeError) as e:
        forms.apply(forms.parse(text, "r.yaml"), form)
    assert str(e.value) == f"form: {PISSA_FOR_DPO}"

    sft = forms.parse(method_yaml("sft", {}).replace("lora:\n  r: 4\n", "lora:\n  r: 4\n  init: pissa\n"), "r.yaml")
    form = forms.values(sft)
    form[field_index("method")] = "kto"  # the same through a change of method
    with pytest.raises(RecipeError, match=r"^form: lora\.init: pissa moves .* and KTO's reference .* for kto$"):
        forms.apply(sft, form)
    for method in ("orpo", "simpo", "rm", "pt", "sft"):  # no reference model: PiSSA is fine
        form[field_index("method")] = method
        assert forms.apply(sft, form).lora.init == "pissa"

    # written in the YAML instead: Validate and Start say it, with the line of `init:`, before the plan or a process
    typed = text.replace("lora:\n  r: 4\n", "lora:\n  r: 4\n  init: pissa\n")
    line = typed.splitlines().index("  init: pissa") + 1
    assert validate_recipe(tmp_path, typed, "r.yaml") == f"error: r.yaml:{line}: {PISSA_FOR_DPO}"
    assert start_job(tmp_path, None, typed, "r.yaml") == f"error: r.yaml:{line}: {PISSA_FOR_DPO}"


def test_validate_says_the_model_dependent_refusals(tmp_path, tiny_moe_dir):
    """DoRA on the MoE's routed experts needs the model to know: the form takes it, and Validate's plan gives peft's
    refusal in the line `erniekit-lite validate` prints; so for loss_weights that do not match loss_type (TRL's)."""
    import os
    import shutil

    from erniekit_lite.webui.train_tab import edit, validate_recipe

    shutil.copy(ROOT / "recipes" / "data" / "identity_dpo.jsonl", tmp_path / "pairs.jsonl")
    root = Path(os.path.commonpath([tmp_path, tiny_moe_dir]))
    text = method_yaml("dpo", {}).replace("runs/tiny-ernie", str(tiny_moe_dir)).replace(
        "recipes/data/identity_dpo.jsonl", str(tmp_path / "pairs.jsonl")).replace("runs/dpo", str(tmp_path / "out"))
    form = forms.values(forms.parse(text, "r.yaml"))
    form[field_index("lora.use_dora")] = True
    dora, status, *_ = edit(text, "r.yaml", form)
    assert status == "" and forms.parse(dora, "r.yaml").lora.use_dora is True
    assert validate_recipe(root, dora, "r.yaml").splitlines()[-1] == (
        "error: lora.use_dora: peft 0.21.2 has no DoRA for the MoE's fused routed-expert weights; set "
        "lora.routed_experts=false (DoRA on attention, dense MLP and shared experts) or lora.use_dora=false")

    form = forms.values(forms.parse(text, "r.yaml"))
    form[field_index("train.loss_type")] = ["sigmoid", "sft"]
    form[field_index("train.loss_weights")] = "1.0"
    weights, status, *_ = edit(text, "r.yaml", form)
    assert status == ""
    assert validate_recipe(root, weights, "r.yaml") == (
        "error: train: `loss_weights` must have the same length as `loss_type` when combining multiple losses. Got 1 "
        "weights for 2 loss types.")


def test_lora_variant_mistakes_are_the_recipes_lines():
    recipe = forms.parse(method_yaml("sft", {}), "r.yaml")
    for key, value, message in (
        ("lora.plus_lr_ratio", 0, "form: lora.plus_lr_ratio: Input should be greater than 0 (got 0)"),
        ("lora.init", "loftq", "form: lora.init: loftq quantizes the base itself and trains against that copy; for a 4-bit "
                               "base use model.load_in_4bit (QLoRA) with init true, or use true, gaussian, orthogonal, mica, "
                               "pissa, pissa_niter_K (K a whole number) or olora (got 'loftq')"),
        ("lora.init", "pisa", "form: lora.init: unknown init 'pisa'; use true, gaussian, orthogonal, mica, pissa, "
                              "pissa_niter_K (K a whole number) or olora (got 'pisa')"),
    ):
        form = forms.values(recipe)
        form[field_index(key)] = value
        with pytest.raises(RecipeError) as e:
            forms.apply(recipe, form)
        assert str(e.value) == message


def test_each_field_has_its_own_page_id():
    from erniekit_lite.webui.train_tab import LAYOUT, _elem_id

    ids = [_elem_id(f) for f in forms.FIELDS]
    assert len(set(ids)) == len(ids)
    assert ids[field_index("train.loss_type", "dpo")] == "train-loss_type"  # as before
    assert ids[field_index("train.loss_type", "kto")] == "train-loss_type-kto"
    assert ids[field_index("lora.plus_lr_ratio")] == "lora-plus_lr_ratio"
    laid_out = [k for row in LAYOUT for k in row]
    assert sorted(laid_out) == sorted({f.key for f in forms.FIELDS})  # each key once; both loss_type fields share a place



def test_a_field_edit_applies_that_field_to_the_recipe_as_the_last_edit_left_it(tmp_path, monkeypatch):
    """A field left or typed in sends its own value; the server applies it to the recipe as the last edit left it,
    one edit at a time in the order they came. Before, each edit sent the whole form as it was when it fired: under
    load the browser test's logging-steps edit, fired before the output dir was typed, landed after it and put the
    recipe's old output dir back (the run trained into runs/quickstart). Through a running server: the first edit
    held for a second, the output dir's waits for it, and a late logging-steps edit keeps the typed output dir."""
    import threading
    import time as clock

    from erniekit_lite.webui import train_tab

    ran, edit = [], train_tab.edit
    first = threading.Event()

    def held_edit(content, file_name, values):
        ran.append(("start", values[field_index("train.logging_steps")], values[field_index("output.dir")]))
        if not first.is_set():
            first.set()
            clock.sleep(1.0)
        ran.append(("end", values[field_index("train.logging_steps")], values[field_index("output.dir")]))
        return edit(content, file_name, values)

    monkeypatch.setattr(train_tab, "edit", held_edit)
    with served_app(tmp_path, monkeypatch) as client:
        client.predict("recipes/quickstart.yaml", api_name="/choose")
        names = form_endpoints(client)
        logging = client.submit(2, api_name=names[field_index("train.logging_steps")])
        assert first.wait(30)
        out = client.submit("runs/mine", api_name=names[field_index("output.dir")])
        out.result(timeout=60)
        logging.result(timeout=60)
        client.predict(2, api_name=names[field_index("train.logging_steps")])  # late: nothing to change
        final, *_ = client.predict(7, api_name=names[field_index("train.max_steps")])
    assert ran == [("start", 2, "runs/quickstart"), ("end", 2, "runs/quickstart"), ("start", 2, "runs/mine"),
                   ("end", 2, "runs/mine"), ("start", 2, "runs/mine"), ("end", 2, "runs/mine"),
                   ("start", 2, "runs/mine"), ("end", 2, "runs/mine")]
    recipe = forms.parse(final, "quickstart.yaml")
    assert (recipe.train["logging_steps"], recipe.train["max_steps"], recipe.output.dir) == (2, 7, "runs/mine")
