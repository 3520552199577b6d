"""Train tab: pick or upload a recipe, edit it as a form or as YAML, validate, preview the data, start and stop
training, and follow it live (progress, loss curve, the method's headline metrics, MoE expert load, log tail).

The YAML text is the single source of truth: a form edit applies its one field to the recipe and rewrites it, a YAML
edit refills the form, and Validate, Preview and Start read it. The form shows the chosen method's own fields only
(forms.FIELDS' `methods`).
"""

from __future__ import annotations

import html
import time
from pathlib import Path

import gradio as gr

from erniekit_lite.errors import UserError
from erniekit_lite.plots import HEADLINE
from erniekit_lite.webui import forms, preview
from erniekit_lite.webui.gate import Checked, Gate
from erniekit_lite.webui.jobs import Runner
from erniekit_lite.webui.paths import recipe_choices

POLL_SECONDS = 1.0
EDITS = "recipe-edits"  # the concurrency group of the events that write the recipe (build)
# The form's rows, by recipe key (each key of forms.FIELDS once; a key's fields for several methods share its place)
LAYOUT = (
    ("model.path", "method"),
    ("data.train", "data.format"),
    ("data.max_length", "data.packing"),
    ("lora", "lora.r", "lora.alpha"),
    ("lora.use_rslora", "lora.use_dora", "lora.init", "lora.plus_lr_ratio"),
    ("train.learning_rate", "train.max_steps", "train.num_train_epochs"),
    ("train.per_device_train_batch_size", "train.logging_steps", "train.ema", "train.offload", "output.dir"),
    # each method's own: one row shows
    ("train.beta", "train.loss_type", "train.loss_weights", "train.simpo_gamma", "train.cpo_alpha"),
    ("train.desirable_weight", "train.undesirable_weight", "train.center_rewards_coefficient"),
    ("train.num_generations", "train.max_completion_length", "train.temperature", "rewards"),  # grpo
    ("train.router_z_loss_coef", "train.router_orthogonal_loss_coef"),  # sft, pt: the MoE router's losses
)
CSS = ".ek-track{background:#e5e7eb;border-radius:4px;height:14px}.ek-bar{background:#f97316;height:14px;border-radius:4px}"


def build(demo: gr.Blocks, gate: Gate, runner: Runner) -> None:
    root = gate.root
    with gr.Tab("Train", id="train"):
        with gr.Row():
            choice = gr.Dropdown(recipe_choices(root), value=None, label="recipe (from recipes/, or shipped with erniekit-lite)",
                                 elem_id="recipe-choice")
            upload = gr.File(label="or upload a recipe", file_types=[".yaml", ".yml"], type="filepath", height=110)
        name = gr.State("recipe.yaml")  # the recipe's file name: in error messages and the job's copy
        # The recipe as the last edit left it, kept on the server (a State is read when its event runs, not when it
        # fires): a field's edit applies that one field to it, so an edit fired from an older form cannot put the
        # other fields back (the browser test, under load, trained into the recipe's output dir, not the typed one)
        current = gr.State("")
        with gr.Row():
            with gr.Column():
                by_field = {}
                for keys in LAYOUT:
                    with gr.Row():
                        by_field.update({f: _component(f) for f in forms.FIELDS if f.key in keys})
                note = gr.Markdown(visible=False, elem_id="method-note")  # what a method needs beyond its fields
                fields = [by_field[f] for f in forms.FIELDS]
                form = [*fields, note]  # what `fill` updates
            with gr.Column():
                text = gr.Code(language="yaml", label="recipe (YAML, editable)", lines=28, max_lines=28, elem_id="recipe-yaml")
        status = gr.Textbox(label="status", interactive=False, elem_id="train-status")
        with gr.Row():
            validate_button = gr.Button("Validate")
            preview_button = gr.Button("Preview data")
            start_button = gr.Button("Start training", variant="primary", elem_id="start")
            stop_button = gr.Button("Stop", variant="stop", elem_id="stop")
        plan_text = gr.Textbox(label="plan (as `erniekit-lite validate` prints it)", lines=10, interactive=False, visible=False,
                               elem_id="plan")
        preview_html = gr.HTML(visible=False, elem_id="preview")
        progress_html = gr.HTML(elem_id="progress")
        with gr.Row():
            loss = gr.LinePlot(x="step", y="value", color="series", title="loss", elem_id="loss-plot")
            headline = gr.LinePlot(x="step", y="value", color="series", title="headline metrics", visible=False,
                                   elem_id="headline-plot")
            expert_load = gr.Image(label="expert load (MoE)", type="filepath", visible=False)
        log = gr.Textbox(label="log (last lines)", lines=15, max_lines=15, interactive=False, autoscroll=True, elem_id="log")

        unchanged = [gr.skip()] * (len(form) + 4)  # for [text, current, name, *form, status]

        def open_text(file_name: str, content: str, loaded: str = "loaded"):
            try:
                recipe = forms.parse(content, file_name)
            except UserError as e:  # show the text anyway, so it can be fixed in the editor
                return [content, content, file_name, *[gr.skip()] * len(form), f"error: {e}"]
            return [content, content, file_name, *fill(recipe), f"{file_name}: {loaded}"]

        def open_file(file: Path):
            return open_text(file.name, file.read_text(encoding="utf-8"))

        @gate.endpoint("choice?", refuse=lambda line: [*unchanged[:-1], f"error: {line}"])
        def choose(opened: tuple[str, str, bool] | None):
            if opened is None:
                return unchanged
            file_name, content, from_package = opened
            return open_text(file_name, content, "loaded (shipped with erniekit-lite)" if from_package else "loaded")

        @gate.endpoint("upload?", refuse=lambda line: [*unchanged[:-1], f"error: {line}"])
        def uploaded(path: Path | None):
            return open_file(path) if path else unchanged

        @gate.endpoint()
        def running_recipe():
            """A new page opens on the recipe of the server's job, if there is one."""
            return open_file(root / runner.job.recipe_file) if runner.job is not None else unchanged

        @gate.endpoint("draft", "name")
        def yaml_edited(content: str, file_name: str):
            try:
                return [content, *fill(forms.parse(content, file_name)), ""]
            except UserError as e:
                return [content, *[gr.skip()] * len(form), f"error: {e}"]

        def field_edited(index: int):
            @gate.endpoint("state", "name", "draft")
            def form_edited(content: str, file_name: str, value):
                """[text, current, status, *form] after field `index` is set to `value` in the current recipe."""
                new_text, *rest = edit_field(content, file_name, index, value)
                return [new_text, new_text, *rest]

            return form_edited

        @gate.endpoint("recipe", "name", refuse=lambda line: gr.update(value=f"error: {line}", visible=True))
        def validate(checked: Checked, file_name: str):
            return gr.update(value=validation(checked), visible=True)

        @gate.endpoint("recipe", "name", refuse=lambda line: (gr.skip(), f"error: {line}"))
        def show_preview(checked: Checked, file_name: str):
            try:
                return gr.update(value=preview.render(checked.recipe, log=lambda line: None), visible=True), ""
            except UserError as e:
                return gr.skip(), f"error: {e}"

        @gate.endpoint("recipe", "name")
        def start(checked: Checked, file_name: str):
            return start_checked(runner, checked)

        @gate.endpoint()
        def edits_landed():
            """Nothing: queued behind the edits still on their way, so the step chained after it reads their result."""

        def after_edits(button: gr.Button, fn, outputs) -> None:
            # A click's inputs are read when its event fires: the field the click just left has its edit still on
            # the way, and would be read as it was before. Chained after a turn in the edits' queue, fn reads it done
            button.click(edits_landed, None, None, concurrency_id=EDITS).then(fn, [text, name], outputs)

        # Every event that writes the recipe (the YAML, `current`, the form) runs in one queue, one at a time, in
        # the order it reached the server (by default each function has a queue of its own)
        loaded = [text, current, name, *form, status]
        choice.input(choose, choice, loaded, concurrency_id=EDITS)
        upload.upload(uploaded, upload, loaded, concurrency_id=EDITS)
        text.input(yaml_edited, [text, name], [current, *form, status], trigger_mode="always_last", concurrency_id=EDITS)
        for index, field in enumerate(fields):
            # blur too: a value pasted or filled in without keystrokes fires no input event in Gradio's textbox
            triggers = [field.input] + ([field.blur] if hasattr(field, "blur") else [])
            gr.on(triggers, field_edited(index), [current, name, field], [text, current, status, *form],
                  trigger_mode="always_last", concurrency_id=EDITS)
        after_edits(validate_button, validate, plan_text)
        after_edits(preview_button, show_preview, [preview_html, status])
        after_edits(start_button, start, status)
        @gate.endpoint()
        def stop():
            return runner.stop()

        @gate.endpoint()
        def show_job():
            return job_view(root, runner)

        stop_button.click(stop, None, status)
        shown = [progress_html, loss, headline, expert_load, log, start_button, stop_button]
        demo.load(running_recipe, None, loaded, concurrency_id=EDITS)
        demo.load(show_job, None, shown)
        gr.Timer(POLL_SECONDS).tick(show_job, None, shown)


def fill(recipe) -> list:
    """Updates for the form (forms.FIELDS, then the method note) showing `recipe`: each field's value, shown only
    for the methods it belongs to, with the help of the recipe's method's TRL config."""
    updates = [gr.update(value=value, visible=forms.shown(field, recipe.method), info=forms.help_text(field, recipe.method))
               for field, value in zip(forms.FIELDS, forms.values(recipe))]
    note = forms.method_note(recipe.method)
    return [*updates, gr.update(value=note, visible=bool(note))]


def edit_field(content: str, file_name: str, index: int, value) -> list:
    """A form edit of one field (forms.FIELDS[index]): `edit` with the recipe's own values and that one changed."""
    try:
        values = forms.values(forms.parse(content, file_name))
    except UserError as e:
        return [gr.skip(), f"error: {e}", *[gr.skip()] * (len(forms.FIELDS) + 1)]
    values[index] = value
    return edit(content, file_name, values)


def edit(content: str, file_name: str, values: list) -> list:
    """A form edit: [the new YAML, the status line, *updates of the form]. The YAML stays as written when the edit
    changes nothing (e.g. a field left unedited); a change of method refills the form, showing the new method's
    fields, and the status line names the train: keys it removed."""
    skip_form = [gr.skip()] * (len(forms.FIELDS) + 1)
    try:
        recipe = forms.parse(content, file_name)
        changed = forms.apply(recipe, values)
    except UserError as e:
        return [gr.skip(), f"error: {e}", *skip_form]
    if changed == recipe:
        return [gr.skip(), gr.skip(), *skip_form]
    if changed.method == recipe.method:
        return [changed.to_yaml(), "", *skip_form]
    return [changed.to_yaml(), forms.dropped(recipe, changed), *fill(changed)]


def validation(checked: Checked) -> str:
    """The plan as `erniekit-lite validate` prints it, ending in `NAME: valid` or the one-line error."""
    from erniekit_lite.plan import plan

    lines: list[str] = []
    try:
        plan(checked.recipe, log=lines.append)
    except UserError as e:
        return "\n".join(lines + [f"error: {e}"])
    return "\n".join(lines + [f"{checked.name}: valid"])


def validate_recipe(root: Path, content: str, file_name: str, exposed: bool = False) -> str:
    """Validate pressed, as the page's event runs it: through the gate, then the plan."""
    return Gate(root, exposed).endpoint("recipe", "name")(lambda checked, name: validation(checked))(content, file_name)


def start_checked(runner: Runner, checked: Checked) -> str:
    """Start pressed: the editor's recipe, admitted and checked as `train` checks it first, becomes the server's job."""
    from erniekit_lite.train import rundir

    recipe = checked.recipe
    try:
        rundir.check(rundir.target(recipe))  # what `train` checks first, answered before a process is started
        job = runner.start(checked.text, checked.name, recipe.output.dir, recipe.method)
    except UserError as e:
        return f"error: {e}"
    return f"started: {job.recipe_file} -> {recipe.output.dir}"


def start_job(root: Path, runner: Runner, content: str, file_name: str, exposed: bool = False) -> str:
    """Start pressed, as the page's event runs it: through the gate, then `start_checked`."""
    return Gate(root, exposed).endpoint("recipe", "name")(lambda checked, name: start_checked(runner, checked))(content, file_name)


def job_view(root: Path, runner: Runner) -> list:
    """The server's job, whichever page started it (this is what reattaches a reloaded page): progress bar, loss
    curve, the method's headline metrics (erniekit_lite.plots.HEADLINE), expert-load heatmap (MoE), log tail, and
    which of Start/Stop can be pressed."""
    job = runner.job
    if job is None:
        return ["<p>No training job yet.</p>", gr.skip(), gr.skip(), gr.skip(), "",
                gr.update(interactive=True), gr.update(interactive=False)]
    p = job.progress()
    picture = root / job.output_dir / "expert_load.png"
    metrics, title = p.headline(job.method), ", ".join(HEADLINE.get(job.method, ())) or "loss"
    return [
        _progress_html(job, p),
        p.curve("loss", "eval_loss"),
        gr.update(value=metrics, visible=not metrics.empty, title=f"{job.method}: {title}"),
        gr.update(value=str(picture) if picture.is_file() else None, visible=picture.is_file()),
        job.log_tail(),
        gr.update(interactive=not job.running()),
        gr.update(interactive=job.running()),
    ]


def _component(field: forms.Field):
    label, info, visible = field.label, forms.help_text(field), not field.methods  # a method's own: shown by `fill`
    elem_id = _elem_id(field)
    if field.kind == "choice":
        # method and data.format are the recipe's Literals; other keys may hold more than the list offers (lora.init's
        # pissa_niter_K, from the YAML), which is shown and kept, and a typed one is checked by the recipe
        return gr.Dropdown(list(field.choices), label=label, info=info, visible=visible, elem_id=elem_id,
                           allow_custom_value=field.key not in ("method", "data.format"))
    if field.kind == "choices":
        return gr.Dropdown(list(field.choices), label=label, info=info, multiselect=True, allow_custom_value=True,
                           visible=visible, elem_id=elem_id)
    if field.kind == "bool":
        return gr.Checkbox(label=label, info=info, visible=visible, elem_id=elem_id)
    if field.kind in ("int", "number"):
        return gr.Number(label=label, info=info, precision=0 if field.kind == "int" else None, visible=visible,
                         elem_id=elem_id)
    return gr.Textbox(label=label, info=info, lines=2 if field.kind == "paths" else 1, visible=visible, elem_id=elem_id)


def _elem_id(field: forms.Field) -> str:
    """The field's id in the page: its key with dashes (train-max_steps), and for a key that another method's field
    has too, the method's name after it (train-loss_type-kto)."""
    first = next(f for f in forms.FIELDS if f.key == field.key)
    return field.key.replace(".", "-") + ("" if field == first else "-" + "-".join(field.methods))


def _progress_html(job, p) -> str:
    """Progress bar with step/total, elapsed and ETA, the last loss, and the job's one-line state."""
    done = p.step / p.max_steps if p.max_steps else 0.0
    facts = [f"step {p.step} / {p.max_steps}", f"{done:.0%}",
             f"training for {_clock((time.time() if job.running() else p.last_time) - p.start_time)}"]
    if p.eta is not None:
        facts.append(f"ETA {_clock(p.eta)}")
    losses = [e["loss"] for e in p.logs if isinstance(e.get("loss"), (int, float))]
    if losses:
        facts.append(f"loss {losses[-1]:.4f}")
    shown = " · ".join(facts) if p.started else ""
    return (f"<div class='ek-track'><div class='ek-bar' style='width:{done:.1%}'></div></div>"
            f"<p id='progress-facts'>{shown}</p><p id='job-state'>{html.escape(job.outcome())}</p>")


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}" if minutes >= 60 else f"{minutes}:{seconds:02d}"
