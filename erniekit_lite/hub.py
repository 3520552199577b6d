"""Push a finished run to the Hugging Face Hub, with a model card.

Uploaded: the adapter or model (with `merged`, the adapter merged into its base), the tokenizer, `recipe.yaml`,
`train_results.json` and the run's other top-level results, `loss.png`, and a generated `README.md` model card.
Never uploaded: `checkpoint-*` dirs (no subdirectory is), optimizer/scheduler/RNG states, `training_args.bin`.

huggingface_hub finds the token (HF_TOKEN, else the login saved by `hf auth login`) and the endpoint (HF_ENDPOINT)
itself; no token is passed, printed or written here. A push changes nothing in the run dir until the upload has
succeeded; then it adds `loss.png` if missing and writes the card to `README.md`, unless a README.md that
erniekit-lite did not write is there (that one is kept, and only the upload gets the card).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from fnmatch import fnmatch
from pathlib import Path

import yaml
from pydantic import ValidationError

from erniekit_lite import retry
from erniekit_lite.data.load import _FILE_SUFFIXES, _looks_like_hub_id
from erniekit_lite.errors import UserError
from erniekit_lite.model.source import adapter_base
from erniekit_lite.plots import write_loss_plot
from erniekit_lite.recipe import HubSection, Recipe
from erniekit_lite.trainer_args import PAIR_METHODS

# The first line of every card we write: a README.md without it is the user's, and is never overwritten
CARD_MARK = "<!-- erniekit-lite model card: `erniekit-lite push` rewrites this file; delete this line to keep your edits -->"
NOT_PUSHED = ("training_args.bin", "*.pt", "*.pth")  # only needed to resume: optimizer.pt, scheduler.pt, rng_state*.pth
RETRY_WAITS = retry.WAITS  # seconds before the 2nd and 3rd try of a step the Hub failed transiently (tests shorten it)
# TRL 1.16's defaults for what the card reports (reading them from TRL would import it: seconds, for a table cell)
TRL_DEFAULTS = {"sft": {"learning_rate": 2e-5}, "pt": {"learning_rate": 2e-5}, "dpo": {"learning_rate": 1e-6, "beta": 0.1, "loss_type": ["sigmoid"]},
                "orpo": {"learning_rate": 1e-6, "beta": 0.1},
                "simpo": {"learning_rate": 1e-6, "beta": 0.1, "simpo_gamma": 0.5, "cpo_alpha": 0.0},  # cpo_alpha: ours (trainer_args)
                "kto": {"learning_rate": 1e-6, "beta": 0.1, "loss_type": "kto", "desirable_weight": 1.0, "undesirable_weight": 1.0},
                "rm": {"learning_rate": 1e-4, "center_rewards_coefficient": None},
                "grpo": {"learning_rate": 1e-6, "beta": 0.0, "loss_type": "dapo", "num_generations": 8, "max_completion_length": 512}}


def settings(repo_id: str, private: bool | None = None, merged: bool = False, revision: str | None = None) -> HubSection:
    """The push options of the command line, checked like a recipe's hub: section. `private`: None (neither --private
    nor --public) creates a new repository private and pushes to an existing one as it is."""
    try:
        return HubSection(repo_id=repo_id, private=private, merged=merged, revision=revision)
    except ValidationError as e:
        raise UserError(f"--repo {repo_id}: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None


def check(recipe: Recipe) -> None:
    """Before training: a recipe that pushes when training ends must be able to (fail now, not hours later)."""
    if recipe.hub is None:
        return
    if recipe.hub.merged and recipe.lora is None and adapter_base(recipe.model.path) is None:
        raise UserError("hub.merged: full fine-tuning saves no adapter to merge; remove hub.merged")
    _need_token(recipe.hub.repo_id)


def after_training(out: Path, recipe: Recipe, log=print) -> None:
    """End of a run, main process: loss.png and the model card in the run dir, then the push the recipe asks for."""
    write_loss_plot(out)
    # Replaces the generic card the trainer's save just wrote. It names the repo only when the repo will hold what
    # the run dir holds (not the merged model).
    pushed_as_is = recipe.hub is not None and not recipe.hub.merged
    card = model_card(out, recipe, repo_id=recipe.hub.repo_id if pushed_as_is else None,
                      revision=recipe.hub.revision if pushed_as_is else None, plot=(out / "loss.png").is_file())
    (out / "README.md").write_text(card, encoding="utf-8")
    if recipe.hub is None:
        return
    try:
        push(out, recipe.hub, log)
    except UserError as e:
        hub = recipe.hub
        flags = "".join(f" {flag}" for flag, on in (("--private", hub.private is True), ("--public", hub.private is False),
                                                     ("--merged", hub.merged)) if on)
        flags += f" --revision {hub.revision}" if hub.revision else ""
        again = f"erniekit-lite push {out} --repo {hub.repo_id}{flags}"
        raise UserError(f"{e} (the trained run is saved in {out}; push it later: {again})") from None


def push(run_dir: str | Path, hub: HubSection, log=print) -> str:
    """Upload a finished run as `hub` says; returns the repository URL. Every problem is a one-line UserError."""
    run = Path(run_dir)
    recipe = _read_recipe(run)
    adapter = (run / "adapter_config.json").is_file()
    if hub.merged and not adapter:
        raise UserError(f"--merged: {run} holds a full fine-tune, not a LoRA adapter; push it without --merged")
    _need_token(hub.repo_id)
    from huggingface_hub import HfApi

    api = HfApi()
    with tempfile.TemporaryDirectory(prefix="erniekit-push-") as tmp:
        stage = Path(tmp)  # what the repo gets: links to the run's files, plus the merged model and the card
        if hub.merged:
            from erniekit_lite.model.merge import merge

            log(f"merging the adapter in {run} into its base (in {stage})")
            merge(str(run), str(stage))
        for file in _pushed_files(run):
            if not (hub.merged and file.name.startswith("adapter_")) and not (stage / file.name).exists():
                (stage / file.name).symlink_to(file.resolve())
        if not (stage / "loss.png").exists():
            write_loss_plot(run, stage / "loss.png")
        (stage / "README.md").write_text(
            model_card(run, recipe, hub.repo_id, hub.merged, hub.revision, plot=(stage / "loss.png").exists()), encoding="utf-8"
        )
        url = _upload(api, stage, hub, log)
        wrote = _keep_local_copies(run, stage, hub, log)
    where = f" (branch {hub.revision})" if hub.revision else ""
    log(f"pushed to {url}{where}" + (f"; wrote {' and '.join(wrote)} in {run}" if wrote else ""))
    return url


def _upload(api, stage: Path, hub: HubSection, log) -> str:
    repo, branch = hub.repo_id, hub.revision or "main"
    # private unless asked to publish: a run pushed by mistake stays with its owner (an existing repo keeps its visibility)
    url = str(_with_retries(lambda: api.create_repo(repo, private=hub.private is not False, exist_ok=True), repo, api, log))
    if hub.private is True and _with_retries(lambda: api.repo_info(repo).private, repo, api, log) is False:
        raise UserError(f"push to {repo}: the repository exists and is public, and --private does not change that; "
                        "make it private in its settings on the Hub first, or push to a new repo")
    if branch != "main":
        _with_retries(lambda: api.create_branch(repo, branch=branch, exist_ok=True), repo, api, log)
    files = sorted(p.name for p in stage.iterdir())
    log(f"uploading {len(files)} files to {url} (branch {branch}): {', '.join(files)}")
    _with_retries(
        lambda: api.upload_folder(repo_id=repo, folder_path=stage, revision=branch, commit_message="Upload with erniekit-lite push"),
        repo, api, log,
    )
    return url


def _keep_local_copies(run: Path, stage: Path, hub: HubSection, log) -> list[str]:
    """After a successful upload: loss.png if the run had none, and the card, unless README.md is the user's."""
    wrote = []
    if not (run / "loss.png").exists() and (stage / "loss.png").exists():
        shutil.copyfile(stage / "loss.png", run / "loss.png")
        wrote.append("loss.png")
    if hub.merged:  # that card describes the merged model, which the run dir does not hold
        return wrote
    readme, card = run / "README.md", (stage / "README.md").read_bytes()
    if readme.exists() and CARD_MARK.encode() not in readme.read_bytes():
        log(f"kept {readme} (not written by erniekit-lite); the uploaded README.md is the generated model card")
    elif not readme.exists() or readme.read_bytes() != card:
        readme.write_bytes(card)
        wrote.append("README.md")
    return wrote


def _with_retries(step, repo: str, api, log):
    """Run one Hub call under the shared retry policy (erniekit_lite/retry.py); any failure becomes a one-line UserError."""
    try:
        # HfHubHTTPError is an OSError; bad metadata a ValueError
        return retry.call(step, "push", log, RETRY_WAITS, catch=(OSError, ValueError, retry.transport_error()))
    except retry.GaveUp as failure:
        raise _explain(failure.error, repo, api.endpoint, failure.attempts) from None


def _explain(error: Exception, repo: str, endpoint: str, attempts: int) -> UserError:
    status, where = retry.status(error), f"push to {repo}"
    if status == 401:
        return UserError(f"{where}: the Hub did not accept the token (401 Unauthorized); "
                         "set HF_TOKEN to a valid write token or run `hf auth login`")
    if status == 403:
        return UserError(f"{where}: the token may not write to {repo} (403 Forbidden); "
                         f"use a token with write access to '{repo.split('/')[0]}'")
    if status == 404:
        return UserError(f"{where}: repository or branch not found (404); check the repo id and that the token can access it")
    if retry.transient(error):
        return UserError(f"{where}: the Hub at {endpoint} kept failing ({retry.describe(error)}, {attempts} tries); "
                         "nothing local was changed, push again later")
    return UserError(f"{where}: {retry.describe(error)}")


def _need_token(repo_id: str) -> None:
    from huggingface_hub import constants, get_token

    if constants.is_offline_mode():
        raise UserError(f"push to {repo_id}: HF_HUB_OFFLINE is set, so the Hub cannot be reached; unset it to push")
    if get_token() is None:
        raise UserError(f"push to {repo_id}: no Hugging Face token; set HF_TOKEN or run `hf auth login` (a token with write access)")


def _read_recipe(run: Path) -> Recipe:
    """The run's resolved recipe. Validated by the schema only: the train: keys were checked when it trained."""
    path = run / "recipe.yaml"
    if not path.is_file():
        raise UserError(f"{run}: not an erniekit-lite run dir (no recipe.yaml)")
    if not (run / "train_results.json").is_file():
        raise UserError(f"{run}: the run has not finished (no train_results.json); push a finished run")
    try:
        return Recipe.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))
    except (yaml.YAMLError, ValidationError) as e:
        raise UserError(f"{path}: not a valid erniekit-lite recipe ({' '.join(str(e).split()[:12])} ...)") from None


def _pushed_files(run: Path) -> list[Path]:
    return [
        p for p in sorted(run.iterdir())
        if p.is_file() and p.name != "README.md" and not any(fnmatch(p.name, pattern) for pattern in NOT_PUSHED)
    ]


def _is_hub_id(path: str) -> bool:
    # The rule data/load.py reads sources by: what exists locally is local; USER/NAME without a file suffix is a Hub id
    return not Path(path).expanduser().exists() and _looks_like_hub_id(path) and Path(path).suffix.lower() not in _FILE_SUFFIXES


def model_card(run: Path, recipe: Recipe, repo_id: str | None = None, merged: bool = False, revision: str | None = None,
               plot: bool = False) -> str:
    """README.md for the run: Hub metadata (YAML header), how to load it, the training setup and the final metrics."""
    from huggingface_hub import ModelCardData

    adapter = _json(run / "adapter_config.json")  # {} for a full fine-tune
    base = adapter.get("base_model_name_or_path") or recipe.model.path
    datasets = list(dict.fromkeys(s.path for s in recipe.data.train + recipe.data.eval if _is_hub_id(s.path)))
    metadata = ModelCardData(
        base_model=base if _is_hub_id(base) else None,  # the Hub knows only its own ids; a local base is named in the text
        library_name="peft" if adapter and not merged else "transformers",
        license="apache-2.0",
        tags=["ernie4.5", "erniekit-lite", recipe.method] + (["lora"] if adapter else []),
        datasets=datasets or None,
        pipeline_tag="text-classification" if recipe.method == "rm" else "text-generation",
    )
    name = repo_id or str(run)
    base_text = f"[{base}](https://huggingface.co/{base})" if _is_hub_id(base) else f"the local checkpoint `{Path(base).name}`"
    if adapter and not merged:
        summary = f"A LoRA adapter for {base_text}"
    else:
        summary = base_text[0].upper() + base_text[1:] + (" with a LoRA adapter merged into its weights" if adapter else " fully fine-tuned")
    sections = [
        CARD_MARK,
        f"# {name.split('/')[-1] if repo_id else run.name}",
        f"{summary}: {recipe.method.upper()} with erniekit-lite.",
        "## Use it",
        _reward_usage(name, revision, repo_id is not None) if recipe.method == "rm" else
        _usage(name, base, revision, bool(adapter) and not merged, _ernie_template(run)),
        "## Training",
        _table(("setting", "value"), _setup_rows(run, recipe, adapter)),
        "## Results",
        _table(("metric", "value"), _result_rows(_json(run / "train_results.json"))),
    ]
    if plot:
        sections.append("![loss](loss.png)")
    sections.append("The full resolved recipe is [recipe.yaml](recipe.yaml); all metrics are in [train_results.json](train_results.json).")
    return f"---\n{metadata.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n"


def _ernie_template(run: Path) -> bool:
    """Whether the run's tokenizer renders ERNIE 4.5's chat format (a run without tokenizer files: the base's, ERNIE)."""
    if not (run / "tokenizer_config.json").is_file():
        return True
    from erniekit_lite.data.template import ErnieTemplate, template_for
    from erniekit_lite.model.load import load_tokenizer

    try:
        return isinstance(template_for(load_tokenizer(str(run))), ErnieTemplate)
    except Exception:  # a tokenizer that cannot load is the loading snippet's problem, not the card's
        return True


# Training tokenizes each prompt and answer on its own (data/template.py); `apply_chat_template(tokenize=True)`
# tokenizes one string, which fuses each earlier answer's first word with the space after `Assistant:` (measured in
# benchmarks/results-serving_tokens.txt). A single-turn prompt is the same either way.
MULTI_TURN = '''
# Multi-turn chats: build the prompt as training did. Each prompt and answer is tokenized on its own;
# apply_chat_template(tokenize=True) tokenizes one string, which changes the first token of every earlier answer.
def prompt_ids(tokenizer, messages):
    encode = lambda text: tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    system = "".join(m["content"] + "\\n" for m in messages if m["role"] == "system" and m["content"])
    ids = [tokenizer.convert_tokens_to_ids("<|begin_of_sentence|>")]
    for m in messages:
        if m["role"] == "user":
            ids += encode(system + "User: " + m["content"] + "\\nAssistant: ")
            system = ""
        elif m["role"] == "assistant":
            ids += encode(m["content"]) + [tokenizer.convert_tokens_to_ids("<|end_of_sentence|>")]
    return torch.tensor([ids])

messages += [{"role": "assistant", "content": "I am a tuned ERNIE."}, {"role": "user", "content": "What can you do?"}]
input_ids = prompt_ids(tokenizer, messages)
output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=128)
print(tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True))
'''


def _usage(name: str, base: str, revision: str | None, adapter: bool, ernie: bool = True) -> str:
    at = f', revision="{revision}"' if revision else ""
    if adapter:
        base = base if _is_hub_id(base) else f"path/to/{Path(base).name}"  # the machine's own paths stay on it
        load = (f'from peft import PeftModel\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n'
                f'base = AutoModelForCausalLM.from_pretrained("{base}")\nmodel = PeftModel.from_pretrained(base, "{name}"{at})\n'
                f'tokenizer = AutoTokenizer.from_pretrained("{name}"{at})\n')
    else:
        load = (f'from transformers import AutoModelForCausalLM, AutoTokenizer\n\n'
                f'model = AutoModelForCausalLM.from_pretrained("{name}"{at})\ntokenizer = AutoTokenizer.from_pretrained("{name}"{at})\n')
    chat = ('\nmessages = [{"role": "user", "content": "Who are you?"}]\n'
            'inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)\n'
            'output = model.generate(**inputs, max_new_tokens=128)\n'
            'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))\n')
    if ernie:
        chat += MULTI_TURN
    text = f"```python\nimport torch\n{load}{chat}```"
    if adapter:
        text += ("\n\n**MoE:** an adapter of an ERNIE 4.5 MoE model (21B-A3B) must not be loaded this way: peft re-targets it and silently "
                 "drops the shared-expert and dense-layer adapters. Load it with erniekit-lite (`model.path:` a download of this "
                 "repo) or push it merged (`erniekit-lite push RUN_DIR --merged`); see erniekit-lite's docs/moe.md.")
    return text


def _reward_usage(name: str, revision: str | None, on_hub: bool) -> str:
    """A reward model scores (prompt, completion) pairs rendered as training rendered them (erniekit_lite.model.reward)."""
    at = f', revision="{revision}"' if revision else ""
    where = f'snapshot_download("{name}"{at})' if on_hub else f'"{name}"'
    fetch = "from huggingface_hub import snapshot_download\n" if on_hub else ""
    return ("```python\n# pip install erniekit-lite; importing erniekit_lite.model.reward also registers the ERNIE 4.5 reward classes\n"
            "# with AutoModelForSequenceClassification\n"
            f"{fetch}from erniekit_lite.model.reward import load_reward_model\n\n"
            f"reward_model = load_reward_model({where})\n"
            'print(reward_model.score([("Who are you?", "I am a tuned ERNIE."), ("Who are you?", "No idea.")]))  # one reward each\n'
            "```\n\nEach (prompt, completion) is rendered with the ERNIE 4.5 template pieces training used (its system prompt "
            "and max_length from recipe.yaml); the reward is the `score` head at the sequence's last token. Called as "
            "`reward_model(prompts=..., completions=...)` it is a TRL reward function.")


def _reward_label(entry) -> str:
    """A GRPO reward as the card names it: a built-in's name, a function by module or file name (not the machine's
    path), or "reward model"."""
    if entry.name is not None:
        return entry.name
    if entry.function is not None:
        where, _, function = entry.function.rpartition(":")
        return f"{Path(where).name}:{function}" if where.endswith(".py") else entry.function
    return "a reward model"


def _setup_rows(run: Path, recipe: Recipe, adapter: dict) -> list[tuple[str, str]]:
    train = {**TRL_DEFAULTS[recipe.method], **recipe.train}
    results, state = _json(run / "train_results.json"), _json(run / "trainer_state.json")
    if recipe.method == "dpo":
        method = f"DPO ({' + '.join(train['loss_type'])}, beta {train['beta']:g})"
    elif recipe.method == "orpo":
        method = f"ORPO (no reference model; odds-ratio weight beta {train['beta']:g}, NLL on the chosen responses)"
    elif recipe.method == "simpo":
        sft = f", NLL weight cpo_alpha {train['cpo_alpha']:g}" if train["cpo_alpha"] else ""
        method = f"SimPO (no reference model; beta {train['beta']:g}, margin simpo_gamma {train['simpo_gamma']:g}{sft})"
    elif recipe.method == "kto":
        kl = "KL term from mismatched completions within each packed row" if train["loss_type"] == "kto" else "no KL term"
        method = (f"KTO ({train['loss_type']}, beta {train['beta']:g}, desirable / undesirable weights "
                  f"{train['desirable_weight']:g} / {train['undesirable_weight']:g}; {kl})")
    elif recipe.method == "rm":
        center = train["center_rewards_coefficient"]
        method = ("reward model (TRL RewardTrainer: -log sigmoid(r_chosen - r_rejected)"
                  + (f" + {center:g} x mean(r^2)" if center else "") + "; a new score head, hidden -> 1, read at each sequence's last token)")
    elif recipe.method == "pt":
        method = "continued pre-training (raw text, every token after each piece's first)"
    elif recipe.method == "grpo":
        rewards = ", ".join(f"{_reward_label(r)} x {r.weight:g}" for r in recipe.rewards or [])
        method = (f"GRPO ({train['loss_type']}, {train['num_generations']} completions per prompt of up to "
                  f"{train['max_completion_length']} tokens, beta {train['beta']:g}; rewards: {rewards})")
    else:
        method = "SFT (loss on assistant turns)"
    if adapter:
        targets = sorted(adapter.get("target_modules") or []) + (["routed experts"] if adapter.get("target_parameters") else [])
        kind = "QLoRA" if recipe.model.load_in_4bit else "LoRA"
        tuning = f"{kind} r {adapter['r']}, alpha {adapter['lora_alpha']:g} on {', '.join(targets)}"
    else:
        tuning = "full fine-tuning"
    rows = [("method", method), ("fine-tuning", tuning)]
    schedule = f", {train['lr_scheduler_type']}" if "lr_scheduler_type" in train else ""
    rows.append(("learning rate", f"{train['learning_rate']:g}{schedule}"))
    if "global_step" in state:
        rows.append(("training", f"{state['global_step']} steps ({results.get('epoch', state.get('epoch', 0)):.2f} epochs)"))
    per = "sequence" if recipe.method in PAIR_METHODS or recipe.method == "kto" else "prompt" if recipe.method == "grpo" else "sample"
    rows.append(("max_length", f"{recipe.data.max_length} tokens per {per}"))
    packing = f"padding-free rows, {results['packing_efficiency']:.1%} filled" if "packing_efficiency" in results else "padding-free rows"
    if recipe.method == "grpo":
        packing = "each micro-batch's prompts + completions scored as one padding-free row"
    rows.append(("packing", packing if recipe.data.packing else "no (padded rows)"))
    if "train_samples" in results:
        unit = ("preference pairs" if recipe.method in PAIR_METHODS else "documents" if recipe.method == "pt"
                else "labelled completions" if recipe.method == "kto" else "prompts" if recipe.method == "grpo" else "samples")
        rows.append(("samples", f"{results['train_samples']} {unit}"))
    # Local files by name only: their paths say nothing to a reader and may say too much about the machine
    sources = [
        f"[{s.path}](https://huggingface.co/datasets/{s.path})" if _is_hub_id(s.path) else f"`{Path(s.path).name}`"
        for s in recipe.data.train
    ]
    rows.append(("data", ", ".join(sources)))
    return rows


def _result_rows(results: dict) -> list[tuple[str, str]]:
    shown = [("train_loss", "train loss", "{:.4f}"), ("eval_loss", "eval loss", "{:.4f}"),
             ("train_tokens_per_second", "real tokens/s", "{:,.0f}"), ("rewards/accuracies", "reward accuracy (last step)", "{:.2f}"),
             ("eval_rewards/accuracies", "eval reward accuracy", "{:.2f}")]
    if "accuracy" in results:  # a reward model: TRL RewardTrainer's own metric names
        shown += [("accuracy", "reward accuracy (last step)", "{:.2f}"), ("margin", "reward margin (last step)", "{:.3f}"),
                  ("eval_accuracy", "eval reward accuracy", "{:.2f}"), ("eval_margin", "eval reward margin", "{:.3f}")]
    if "kl" in results:  # KTO: no pairs, so no accuracy; its margin is between the desirable and undesirable means
        shown += [("rewards/margins", "reward margin (last step)", "{:.3f}"), ("eval_rewards/margins", "eval reward margin", "{:.3f}"),
                  ("kl", "KL estimate (last step)", "{:.3f}")]
    return [(label, fmt.format(results[key])) for key, label, fmt in shown if isinstance(results.get(key), (int, float))]


def _table(header: tuple[str, str], rows: list[tuple[str, str]]) -> str:
    return "\n".join([f"| {header[0]} | {header[1]} |", "| --- | --- |"] + [f"| {a} | {b} |" for a, b in rows])


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
