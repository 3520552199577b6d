"""Web UI job runner, with a stand-in for `erniekit-lite train` that follows the same contract (progress.jsonl
events, SIGTERM finishes the step, saves a checkpoint, writes the end event and exits 143): start, live progress,
one job at a time, reattaching from a new page, stop with a checkpoint or with nothing saved yet, failures.

Then the runner under abuse (click storms, stops while data loads, two sessions or two servers pressing Start at
once), with the stand-in and with the real CLI on a tiny model: at most one training process at any moment, no
process left behind, and every stop ends with a checkpoint that loads or a plain "nothing saved yet"."""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

from erniekit_lite.errors import UserError
from erniekit_lite.webui import progress
from erniekit_lite.webui.jobs import STATE_DIR, Runner

# Reads output.dir and train.max_steps from the recipe it is given; FAKE_PREPARE seconds of "loading" come first
# (no handler yet: SIGTERM kills it, as it kills the real CLI before training starts); FAKE_HELPER starts a helper
# process first; FAKE_FAIL fails like the CLI; FAKE_LOG_EXTRA (JSON) is added to every log event; FAKE_FINISH
# seconds of "saving the model" come after the last step (with FAKE_FINAL_CHECKPOINT, after saving its checkpoint).
FAKE_TRAIN = r"""
import json, os, signal, sys, time
import yaml
recipe = yaml.safe_load(open(sys.argv[1]))
out, steps = recipe["output"]["dir"], recipe["train"]["max_steps"]
print("loading", flush=True)
if os.environ.get("FAKE_HELPER"):  # a helper process, as data loading may start; orphaned if SIGTERM ends this one
    import subprocess
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(f"helper {helper.pid}", flush=True)
time.sleep(float(os.environ.get("FAKE_PREPARE", "0")))
if os.environ.get("FAKE_FAIL"):
    print("error: data.train.0.path: missing.jsonl: file not found", file=sys.stderr)
    sys.exit(2)
os.makedirs(out, exist_ok=True)
def event(**e):
    with open(os.path.join(out, "progress.jsonl"), "a") as f:
        f.write(json.dumps({**e, "max_steps": steps, "time": time.time()}) + "\n")
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
event(event="start", step=0)
for step in range(1, steps + 1):
    time.sleep(float(os.environ.get("FAKE_STEP", "0.02")))
    extra = json.loads(os.environ.get("FAKE_LOG_EXTRA", "{}"))
    event(event="log", step=step, loss=10.0 / step, learning_rate=1e-3, epoch=step / steps, **extra)
    print(f"\r{step}/{steps} \x1b[A", end="\n" if step == steps else "", flush=True)
    if stop:
        os.makedirs(os.path.join(out, f"checkpoint-{step}"), exist_ok=True)
        event(event="end", step=step, status="stopped", checkpoint=os.path.join(out, f"checkpoint-{step}"))
        print(f"stopped at step {step} of {steps}", file=sys.stderr)
        sys.exit(143)
if os.environ.get("FAKE_FINISH"):  # the checkpoint of the last step, then the final save, with no handler (as the CLI)
    if os.environ.get("FAKE_FINAL_CHECKPOINT"):
        os.makedirs(os.path.join(out, f"checkpoint-{steps}"), exist_ok=True)
        open(os.path.join(out, f"checkpoint-{steps}", "trainer_state.json"), "w").write("{}")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    print("saving the model", flush=True)
    time.sleep(float(os.environ["FAKE_FINISH"]))
event(event="end", step=steps, status="finished", checkpoint=None)
"""


def recipe_text(out: str = "runs/fake", steps: int = 5) -> str:
    return f"model: {{path: m}}\ndata: {{train: [d.jsonl]}}\noutput: {{dir: {out}}}\ntrain: {{max_steps: {steps}}}\n"


@pytest.fixture
def runner(tmp_path):
    runner = Runner(tmp_path, (sys.executable, "-c", FAKE_TRAIN))
    yield runner
    if runner.job is not None and runner.job.running():
        runner.job.process.kill()
        runner.job.process.wait()


def wait_for(condition, seconds: float = 30) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_a_job_runs_to_the_end_with_live_progress(runner, tmp_path):
    user_recipe = tmp_path / "recipes" / "mine.yaml"
    user_recipe.parent.mkdir()
    user_recipe.write_text("# the user's own file\n")
    job = runner.start(recipe_text(steps=5), "mine.yaml", "runs/fake")
    assert job.recipe_file.parts[0] == STATE_DIR and (tmp_path / job.recipe_file).read_text() == recipe_text(steps=5)
    assert user_recipe.read_text() == "# the user's own file\n"  # never written over
    job.process.wait(timeout=30)
    p = job.progress()
    assert p.started and p.step == p.max_steps == 5 and p.end["status"] == "finished" and p.eta is None
    assert p.curve("loss")["value"].tolist() == [10.0, 5.0, 10 / 3, 2.5, 2.0]
    assert job.outcome() == "finished: 5 steps; the model is in runs/fake"
    assert job.log_tail() == "loading\n5/5"  # a progress bar's carriage returns and cursor moves are not shown


def test_one_job_at_a_time_and_any_page_sees_it(runner, tmp_path, monkeypatch):
    from erniekit_lite.webui.train_tab import job_view

    monkeypatch.setenv("FAKE_STEP", "0.5")
    job = runner.start(recipe_text(steps=100), "a.yaml", "runs/fake")
    with pytest.raises(UserError, match=r"^a job is already running \(.*a\.yaml\); stop it or wait until it ends$"):
        runner.start(recipe_text(out="runs/other"), "b.yaml", "runs/other")
    wait_for(lambda: job.progress().step >= 1)
    # The page's view comes from the server's runner alone: a reloaded page or a second browser shows the same job
    page_html, loss, *_, start_button, stop_button = job_view(tmp_path, runner)
    assert re.search(r"step \d+ / 100 · \d+% · training for 0:\d\d · ETA \d+:\d\d · loss ", page_html)
    assert "training (" in page_html
    assert loss["value"].tolist()[0] == 10.0
    assert start_button["interactive"] is False and stop_button["interactive"] is True


def test_the_methods_headline_metrics_and_moe_expert_load_are_shown_when_logged(runner, tmp_path, monkeypatch):
    from PIL import Image

    from erniekit_lite.webui.train_tab import job_view

    # Every method's metrics logged at once: each job's plot takes its own method's (erniekit_lite.plots.HEADLINE)
    monkeypatch.setenv("FAKE_LOG_EXTRA", '{"rewards/accuracies": 0.75, "rewards/margins": 0.5, "kl": 0.125, '
                                         '"accuracy": 0.625, "margin": 1.5, "mean_token_accuracy": 0.3}')
    runner.start(recipe_text(steps=2), "a.yaml", "runs/fake").process.wait(timeout=30)
    _, _, headline, expert_load, *_ = job_view(tmp_path, runner)
    assert headline["visible"] is False and expert_load["visible"] is False  # SFT (the loss is its headline), dense

    shown = {}
    for method in ("dpo", "orpo", "simpo", "kto", "rm", "pt"):
        runner.start(recipe_text(steps=2), "a.yaml", "runs/fake", method).process.wait(timeout=30)
        _, loss, headline, *_ = job_view(tmp_path, runner)
        assert loss["value"].tolist() == [10.0, 5.0]  # this job's run only, not the previous ones in the same dir
        frame = headline["value"]
        shown[method] = (headline["visible"], headline["title"], sorted(set(zip(frame["series"], frame["value"]))),
                         sorted(frame["step"].tolist()))
    pair = (True, "dpo: rewards/accuracies, rewards/margins", [("rewards/accuracies", 0.75), ("rewards/margins", 0.5)], [1, 1, 2, 2])
    assert shown == {
        "dpo": pair,
        "orpo": (True, "orpo: rewards/accuracies, rewards/margins", *pair[2:]),
        "simpo": (True, "simpo: rewards/accuracies, rewards/margins", *pair[2:]),
        "kto": (True, "kto: rewards/margins, kl", [("kl", 0.125), ("rewards/margins", 0.5)], [1, 1, 2, 2]),
        "rm": (True, "rm: accuracy, margin", [("accuracy", 0.625), ("margin", 1.5)], [1, 1, 2, 2]),
        "pt": (False, "pt: loss", [], []),
    }

    Image.new("RGB", (4, 4)).save(tmp_path / "runs" / "fake" / "expert_load.png")
    runner.start(recipe_text(steps=2), "a.yaml", "runs/fake").process.wait(timeout=30)
    *_, expert_load, _, _, _ = job_view(tmp_path, runner)
    assert expert_load["visible"] is True and expert_load["value"] == str(tmp_path / "runs" / "fake" / "expert_load.png")


def test_eval_metrics_join_the_headline_plot(tmp_path):
    lines = [{"event": "start", "step": 0, "max_steps": 4, "time": 1.0},
             {"event": "log", "step": 2, "max_steps": 4, "time": 2.0, "rewards/margins": 0.5, "kl": 0.25},
             {"event": "log", "step": 2, "max_steps": 4, "time": 2.5, "eval_rewards/margins": 0.375, "eval_kl": 0.0625,
              "eval_loss": 0.4}]
    (tmp_path / "progress.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    frame = progress.read(tmp_path, since=0).headline("kto")
    assert frame.values.tolist() == [[2, 0.5, "rewards/margins"], [2, 0.25, "kl"], [2, 0.375, "eval_rewards/margins"],
                                     [2, 0.0625, "eval_kl"]]
    assert progress.read(tmp_path, since=0).headline("sft").empty

    grpo = {"event": "log", "step": 2, "max_steps": 4, "time": 2.0, "reward": 0.5, "rewards/length/mean": -0.25,
            "rewards/exact_answer/mean": 1.0, "completions/mean_length": 9.0, "reward_std": 0.1}
    (tmp_path / "progress.jsonl").write_text("".join(json.dumps(e) + "\n" for e in (lines[0], grpo)))
    assert progress.read(tmp_path, since=0).headline("grpo").values.tolist() == [
        [2, 0.5, "reward"], [2, 1.0, "rewards/exact_answer/mean"], [2, -0.25, "rewards/length/mean"],
        [2, 9.0, "completions/mean_length"]]


def test_loss_png_draws_the_same_headline_metrics_found_from_the_log():
    """loss.png (erniekit_lite.plots) reads the same HEADLINE: its panels, for a run dir that does not say its method."""
    from erniekit_lite.plots import panels

    def history(**metrics):
        return [{"step": 1, "loss": 2.0, **metrics}, {"step": 2, "loss": 1.0, **metrics}]

    def shown(h, method=None):
        return [(title, {label: [v for _, v in found] for label, found in curves.items()}) for title, curves in panels(h, method)]

    both = {"rewards/accuracies": 0.5, "rewards/margins": 0.25}
    assert shown(history(**both, kl=9.0)) == [("loss", {"train": [2.0, 1.0]}), ("rewards/accuracies", {"train": [0.5, 0.5]}),
                                              ("rewards/margins", {"train": [0.25, 0.25]})]
    assert shown(history(**{"rewards/margins": 0.25, "kl": 0.125})) == [
        ("loss", {"train": [2.0, 1.0]}), ("rewards/margins", {"train": [0.25, 0.25]}), ("kl", {"train": [0.125, 0.125]})]
    assert shown(history(accuracy=0.75, margin=3.0, mean_token_accuracy=0.1)) == [
        ("loss", {"train": [2.0, 1.0]}), ("accuracy", {"train": [0.75, 0.75]}), ("margin", {"train": [3.0, 3.0]})]
    grpo = {"reward": 0.5, "reward_std": 0.25, "rewards/exact_answer/mean": 0.0, "rewards/digits/mean": 1.0,
            "completions/mean_length": 12.0, "kl": 0.0}  # each reward function's mean: a panel of its own
    assert [title for title, _ in shown(history(**grpo))] == ["loss", "reward", "rewards/digits/mean",
                                                              "rewards/exact_answer/mean", "completions/mean_length", "kl"]
    del grpo["kl"]  # beta 0: no KL logged, still GRPO
    assert [title for title, _ in shown(history(**grpo))][-1] == "completions/mean_length"
    assert shown(history(mean_token_accuracy=0.5)) == [("loss", {"train": [2.0, 1.0]})]  # sft: the loss alone
    assert shown(history(**both), method="sft") == [("loss", {"train": [2.0, 1.0]})]  # a method given is taken
    assert shown([*history(), {"step": 2, "eval_loss": 1.5}]) == [("loss", {"train": [2.0, 1.0], "eval": [1.5]})]


def test_stop_saves_a_checkpoint(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_STEP", "0.1")
    job = runner.start(recipe_text(steps=1000), "a.yaml", "runs/fake")
    wait_for(lambda: job.progress().step >= 2)
    assert runner.stop() == "stopping: the current step finishes, then a checkpoint is saved"
    assert job.process.wait(timeout=30) == 143
    end = job.progress().end
    assert end["status"] == "stopped" and (tmp_path / end["checkpoint"]).is_dir()
    assert job.outcome() == (f"stopped at step {end['step']} of 1000: checkpoint saved in {end['checkpoint']} "
                             "(to go on, set train.resume_from_checkpoint: auto in the recipe and start again)")
    assert runner.stop() == "no job is running"
    runner.start(recipe_text(steps=1), "a.yaml", "runs/fake").process.wait(timeout=30)  # a new job may start now


def test_stop_before_training_starts_saves_nothing(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PREPARE", "60")
    job = runner.start(recipe_text(), "a.yaml", "runs/fake")
    wait_for(lambda: "loading" in job.log_tail())
    assert job.outcome().startswith("preparing data and model")
    runner.stop()
    job.process.wait(timeout=30)
    assert job.outcome() == "stopped before training began: nothing saved yet"
    assert not (tmp_path / "runs" / "fake").exists()


@pytest.mark.parametrize("final_checkpoint", [True, False], ids=["checkpoint", "none"])
def test_stop_after_the_last_step_names_what_was_saved(runner, tmp_path, monkeypatch, final_checkpoint):
    earlier = tmp_path / "runs" / "fake" / "checkpoint-1"  # an earlier run's, in the same dir: not this job's
    earlier.mkdir(parents=True)
    (earlier / "trainer_state.json").write_text("{}")
    os.utime(earlier / "trainer_state.json", (0, 0))
    monkeypatch.setenv("FAKE_FINISH", "60")
    if final_checkpoint:
        monkeypatch.setenv("FAKE_FINAL_CHECKPOINT", "1")
    job = runner.start(recipe_text(steps=3), "a.yaml", "runs/fake")
    wait_for(lambda: "saving the model" in job.log_tail())
    runner.stop()
    assert job.process.wait(timeout=30) == -15  # the training loop is over: no handler, SIGTERM ends it at once
    saved = "checkpoint saved in runs/fake/checkpoint-3" if final_checkpoint else "nothing saved yet"
    assert job.outcome() == f"stopped after step 3 (exit status -15): {saved}"


def test_a_failed_job_shows_the_clis_error(runner, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "1")
    job = runner.start(recipe_text(), "a.yaml", "runs/fake")
    job.process.wait(timeout=30)
    assert job.outcome() == "failed (exit status 2): error: data.train.0.path: missing.jsonl: file not found"


def test_progress_ignores_earlier_runs_in_the_same_dir(tmp_path):
    lines = [{"event": "start", "step": 0, "max_steps": 9, "time": 100.0},
             {"event": "log", "step": 3, "max_steps": 9, "time": 103.0, "loss": 1.0},
             {"event": "end", "step": 3, "max_steps": 9, "time": 104.0, "status": "stopped", "checkpoint": "c"}]
    (tmp_path / "progress.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert not progress.read(tmp_path, since=200.0).started  # this job's run has not started yet
    later = [{"event": "start", "step": 3, "max_steps": 9, "time": 201.0},
             {"event": "log", "step": 6, "max_steps": 9, "time": 204.0, "loss": 0.5}]
    with open(tmp_path / "progress.jsonl", "a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in later) + '{"event": "lo')  # a line being written
    p = progress.read(tmp_path, since=200.0)
    assert (p.step, p.max_steps, p.end, p.curve("loss")["value"].tolist()) == (6, 9, None, [0.5])
    assert p.eta == pytest.approx(3.0 / 6 * 3)


# Under abuse: click storms, stops during data loading, two sessions (and two servers) at once. Each test watches
# the processes all along: at most one training process at any moment, none left once a job has ended, and every
# stop ends with a checkpoint that loads or a plain "nothing saved yet".

def training_processes() -> list:
    """This test process's live job processes (fake or real CLI): those given a recipe copy in the UI's state dir."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and child.cmdline()[-1:] and child.cmdline()[-1].startswith(STATE_DIR):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


class ProcessWatch:
    """Counts the training processes every few milliseconds while the block runs."""

    def __init__(self):
        import threading

        self.most, self._done = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self._done.is_set():
            self.most = max(self.most, len(training_processes()))
            time.sleep(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()


def process_tree(job) -> list:
    import psutil

    try:
        parent = psutil.Process(job.process.pid)
        return [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def assert_gone(processes: list, seconds: float = 15) -> None:
    import psutil

    psutil.wait_procs(processes, timeout=seconds)
    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:  # a zombie has ended; only its parent may reap it
                alive.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    assert not alive, f"left running: {alive}"


def test_stop_during_data_loading_ends_the_helpers_too(runner, tmp_path, monkeypatch):
    import psutil

    monkeypatch.setenv("FAKE_PREPARE", "60")
    monkeypatch.setenv("FAKE_HELPER", "1")
    job = runner.start(recipe_text(), "a.yaml", "runs/fake")
    wait_for(lambda: "helper" in job.log_tail())
    helper = psutil.Process(int(re.search(r"helper (\d+)", job.log_tail()).group(1)))
    assert runner.stop() == "stopping: training had not begun, so nothing is saved"
    assert job.process.wait(timeout=30) == -15  # no handler yet: SIGTERM ended it at once
    assert_gone([helper])  # orphaned by that, and ended by the runner
    assert job.outcome() == "stopped before training began: nothing saved yet"
    monkeypatch.delenv("FAKE_HELPER")
    monkeypatch.setenv("FAKE_PREPARE", "0")
    wait_for(lambda: _starts(runner))  # the job lock, which the helper had inherited, is free again
    runner.job.process.wait(timeout=30)
    assert runner.job.outcome() == "finished: 5 steps; the model is in runs/fake"


def _starts(runner) -> bool:
    try:
        runner.start(recipe_text(), "a.yaml", "runs/fake")
        return True
    except UserError as e:
        assert str(e) == "the last job's processes are still ending; start again in a moment"
        return False


def test_a_click_storm_runs_one_job_at_a_time_and_every_stop_is_clean(runner, tmp_path, monkeypatch):
    import random

    monkeypatch.setenv("FAKE_STEP", "0.05")
    monkeypatch.setenv("FAKE_PREPARE", "0.2")
    rng = random.Random(0)
    jobs, refused = [], set()

    outcomes = {}  # each job's, taken before the next job writes to the same run dir

    def click(button: str) -> None:
        if button == "stop":
            runner.stop()
            return
        previous = runner.job
        if previous is not None and not previous.running():
            outcomes.setdefault(id(previous), previous.outcome())
        try:
            jobs.append(runner.start(recipe_text(steps=rng.choice([3, 40])), "a.yaml", "runs/fake"))
        except UserError as e:
            refused.add(str(e).split(" (")[0].split(";")[0])

    with ProcessWatch() as watch:
        for round in range(12):
            click("start")
            # Stop right away (the CLI is starting), during "loading", once training runs, or at a random time
            if round % 4 == 2 and jobs and jobs[-1].running():
                wait_for(lambda: jobs[-1].progress().started or not jobs[-1].running())
            else:
                time.sleep([0, 0.1, 0, rng.uniform(0, 0.6)][round % 4])
            for button in rng.choices(["stop", "start"], weights=[3, 1], k=6):  # a burst of clicks
                click(button)
                time.sleep(rng.choice([0, 0.005, 0.02]))
        runner.stop()
        for job in jobs:
            job.process.wait(timeout=30)
    assert watch.most == 1 and len(jobs) >= 12, (watch.most, len(jobs))
    assert refused <= {"a job is already running", "the last job", "the last job's processes are still ending"}, refused
    kinds, seen = set(), []  # seen: each job's outcome, said when an assertion fails (a rare failure was not reproduced)
    for job in jobs:
        assert_gone(process_tree(job))
        outcome = outcomes.get(id(job)) or job.outcome()
        seen.append(outcome)
        stopped = re.fullmatch(r"stopped at step (\d+) of \d+: checkpoint saved in (\S+) \(to go on, .*\)", outcome)
        if stopped:
            assert (tmp_path / stopped.group(2)).is_dir() and stopped.group(2).endswith(f"checkpoint-{stopped.group(1)}"), seen
            kinds.add("checkpoint")
        else:
            assert outcome in ("stopped before training began: nothing saved yet",
                               f"finished: {job.progress().max_steps} steps; the model is in runs/fake"), seen
            kinds.add(outcome.split(":")[0])
    assert {"checkpoint", "stopped before training began"} <= kinds, seen


@pytest.mark.parametrize("servers", [1, 2], ids=["two-sessions-one-server", "two-servers-one-dir"])
def test_two_sessions_pressing_start_at_once_start_one_job(tmp_path, monkeypatch, servers):
    """Two browser sessions share the server's runner; two servers started in one directory each have their own."""
    import threading

    monkeypatch.setenv("FAKE_STEP", "0.05")
    runners = [Runner(tmp_path, (sys.executable, "-c", FAKE_TRAIN)) for _ in range(servers)]
    sessions = [runners[0], runners[-1]]
    barrier, results = threading.Barrier(2), [None, None]
    # one server runs one job; two servers, one run per output folder (the run's own lock, as `train` takes it)
    outs = [f"runs/session{i}" for i in range(2)] if servers == 1 else ["runs/shared"] * 2

    def press_start(i: int):
        barrier.wait()
        try:
            results[i] = sessions[i].start(recipe_text(out=outs[i], steps=1000), f"s{i}.yaml", outs[i])
        except UserError as e:
            results[i] = e

    try:
        with ProcessWatch() as watch:
            threads = [threading.Thread(target=press_start, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            [job] = [r for r in results if not isinstance(r, UserError)]
            [error] = [str(r) for r in results if isinstance(r, UserError)]
            owner, other = sessions[results.index(job)], sessions[1 - results.index(job)]
            if servers == 1:
                assert error == f"a job is already running ({job.recipe_file}); stop it or wait until it ends"
            else:  # the holder: the job's process, or its server before the process had started
                assert re.fullmatch(re.escape("output.dir: runs/shared is in use by another run ")
                                    + rf"\(pid ({job.process.pid}|{os.getpid()})\)"
                                    + re.escape("; wait until it ends, or choose another output.dir"), error), error
                assert other.stop() == "no job is running"  # the other server cannot see, or stop, this job
            wait_for(lambda: job.progress().step >= 1)
            assert owner.stop() == "stopping: the current step finishes, then a checkpoint is saved"
            assert job.process.wait(timeout=30) == 143
            assert job.progress().end["status"] == "stopped" and (tmp_path / job.progress().end["checkpoint"]).is_dir()
            wait_for(lambda: _starts_other(other))  # once it has ended, the other session or server may start one
            other.stop()
            other.job.process.wait(timeout=30)
        assert watch.most == 1
        assert_gone(process_tree(job) + process_tree(other.job))
    finally:
        for r in runners:
            if r.job is not None and r.job.running():
                r.job.process.kill()


def _starts_other(runner) -> bool:
    try:
        runner.start(recipe_text(out="runs/other", steps=1000), "o.yaml", "runs/other")
        return True
    except UserError as e:
        assert "still ending" in str(e) or "in use by another run" in str(e)
        return False


# The real `erniekit-lite train` command up to its run, which is stood in for by a wait: what is tested is the run
# lock it takes over from the server (else it would refuse its own job's folder)
LOCKING_CLI = r"""
import sys, time
from erniekit_lite import cli
def run(*args, **kwargs):
    print("holding the run lock", flush=True)
    time.sleep(600)
cli._train_holding = run
sys.exit(cli.main(["train", *sys.argv[1:]]))
"""
HOLDER = r"""
import sys, time
from erniekit_lite.train import run_lock
with run_lock.hold(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_job_and_a_train_from_a_terminal_refuse_each_others_folder(tmp_path):
    """The job's lock is the run's own: `train` into the folder of a running job is refused naming the job's process,
    a job into a folder a run holds is refused naming that run's, and a killed holder blocks nothing."""
    import signal
    import subprocess

    runner = Runner(tmp_path, (sys.executable, "-c", LOCKING_CLI))
    job = runner.start(recipe_text(out="runs/a"), "a.yaml", "runs/a")
    try:
        wait_for(lambda: "holding the run lock" in job.log_tail() or not job.running())
        assert job.running(), job.log_tail()  # it took over the lock the server took for it
        (tmp_path / "mine.yaml").write_text(recipe_text(out="runs/a"))
        done = subprocess.run([sys.executable, "-m", "erniekit_lite", "train", "mine.yaml"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stderr) == (2, f"error: output.dir: runs/a is in use by another run (pid "
                                                     f"{job.process.pid}); wait until it ends, or choose another output.dir\n")
        assert not (tmp_path / "runs" / "a").exists()  # neither wrote in it
    finally:
        job.process.kill()
        job.process.wait()

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, "runs/b"], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(UserError, match="^" + re.escape(f"output.dir: runs/b is in use by another run (pid {holder.pid}); "
                                                            "wait until it ends, or choose another output.dir") + "$"):
            runner.start(recipe_text(out="runs/b"), "b.yaml", "runs/b")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    job = runner.start(recipe_text(out="runs/b"), "b.yaml", "runs/b")
    try:
        wait_for(lambda: "holding the run lock" in job.log_tail() or not job.running())
        assert job.running(), job.log_tail()
    finally:
        job.process.kill()
        job.process.wait()


# The real `erniekit-lite train` on a tiny model. Data loading waits while the file `hold` exists in the job's
# working directory, so a stop can land there for certain.
HELD_CLI = r"""
import os, sys, time
from erniekit_lite.data import load, prepare
from erniekit_lite.cli import main
read_records = load.read_records
def held(*args, **kwargs):
    print("reading data", flush=True)
    while os.path.exists("hold"):
        time.sleep(0.05)
    return read_records(*args, **kwargs)
load.read_records = prepare.read_records = held
sys.exit(main(["train", *sys.argv[1:]]))
"""


def real_recipe(model_dir) -> str:
    from pathlib import Path

    data = Path(__file__).resolve().parents[1] / "recipes" / "data" / "identity.jsonl"
    return (f"model: {{path: {model_dir}}}\ndata: {{train: [{data}], max_length: 128}}\nlora: {{r: 4, alpha: 8}}\n"
            "output: {dir: runs/real}\n"
            "train: {max_steps: 500, learning_rate: 1.0e-3, per_device_train_batch_size: 1, logging_steps: 1, save_steps: 1000, "
            "activation_checkpointing: false, seed: 0}\n")


@pytest.fixture
def real_runner(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    runner = Runner(tmp_path, (sys.executable, "-c", HELD_CLI))
    yield runner
    if runner.job is not None and runner.job.running():
        runner.job.process.kill()
        runner.job.process.wait()


def test_real_cli_stopped_while_loading_data_saves_nothing_and_leaves_nothing(real_runner, tmp_path, tiny_own_dir):
    (tmp_path / "hold").touch()
    with ProcessWatch() as watch:
        job = real_runner.start(real_recipe(tiny_own_dir), "real.yaml", "runs/real")
        wait_for(lambda: "reading data" in job.log_tail(), 120)
        tree = process_tree(job)
        assert job.outcome() == f"preparing data and model ({job.recipe_file})"
        assert [real_runner.stop() for _ in range(3)][0] == "stopping: training had not begun, so nothing is saved"
        assert job.process.wait(timeout=30) == -15
        assert job.outcome() == "stopped before training began: nothing saved yet"
        # Start and stop again at once, while the CLI is still starting up
        again = real_runner.start(real_recipe(tiny_own_dir), "real.yaml", "runs/real")
        real_runner.stop()
        again.process.wait(timeout=30)
        assert again.outcome() == "stopped before training began: nothing saved yet"
    assert watch.most == 1
    assert_gone(tree + process_tree(again))
    assert not (tmp_path / "runs" / "real").exists()  # the run dir is claimed only after the data and model load


def test_real_cli_click_storm_while_training_leaves_a_checkpoint_that_loads(real_runner, tmp_path, tiny_own_dir):
    import torch

    from erniekit_lite.model.load import load_model

    with ProcessWatch() as watch:
        job = real_runner.start(real_recipe(tiny_own_dir), "real.yaml", "runs/real")
        wait_for(lambda: job.progress().step >= 1 or not job.running(), 120)
        tree = process_tree(job)
        answers = []
        for button in ["stop", "start", "stop", "stop", "start", "stop"]:  # one SIGTERM only: a second would kill the save
            try:
                if button == "stop":
                    answers.append(real_runner.stop())
                else:
                    answers.append(real_runner.start(real_recipe(tiny_own_dir), "b.yaml", "runs/b"))
            except UserError as e:
                answers.append(str(e))
        assert answers[0] == "stopping: the current step finishes, then a checkpoint is saved"
        assert set(answers[1:]) <= {answers[0], "no job is running",
                                    f"the last job ({job.recipe_file}) is still stopping; start again when it has ended"}
        assert job.process.wait(timeout=60) == 143
    assert watch.most == 1
    assert_gone(tree)
    outcome = job.outcome()
    stopped = re.fullmatch(r"stopped at step (\d+) of 500: checkpoint saved in (\S+) \(to go on, .*\)", outcome)
    assert stopped, outcome
    checkpoint = tmp_path / stopped.group(2)
    assert checkpoint == tmp_path / "runs" / "real" / f"checkpoint-{stopped.group(1)}"
    tuned, base = load_model(str(checkpoint), trainable_adapter=False).eval(), load_model(str(tiny_own_dir)).eval()
    ids = torch.tensor([[3, 10, 20, 30, 40]])
    with torch.no_grad():
        tuned_logits, base_logits = tuned(input_ids=ids).logits, base(input_ids=ids).logits
    assert torch.isfinite(tuned_logits).all() and not torch.allclose(tuned_logits, base_logits)  # the trained adapter


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dpo", "orpo", "simpo", "kto", "rm", "pt", "grpo"])
def test_a_quickstart_recipe_trains_from_the_web_ui_and_plots_its_headline_metrics(tmp_path, monkeypatch, tiny_own_dir, method):
    """recipes/quickstart-METHOD.yaml, shortened in the form and started as the Start button does, trains with the
    real CLI; the page's plots hold exactly what the Trainer logged: the loss, and the method's headline metrics."""
    import math
    import shutil
    from pathlib import Path

    from erniekit_lite.plots import headline_keys, panels
    from erniekit_lite.webui import forms
    from erniekit_lite.webui.train_tab import job_view, start_job

    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "recipes" / "data", tmp_path / "recipes" / "data")
    shutil.copytree(tiny_own_dir, tmp_path / "runs" / "tiny-ernie")  # the recipe's model.path, inside the UI's root
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    name = f"quickstart-{method}.yaml"
    recipe = forms.parse((root / "recipes" / name).read_text(encoding="utf-8"), name)
    form = forms.values(recipe)
    keys = [f.key for f in forms.FIELDS]
    form[keys.index("train.max_steps")], form[keys.index("train.logging_steps")] = 3, 1
    text = forms.apply(recipe, form).to_yaml()

    runner = Runner(tmp_path)
    try:
        assert start_job(tmp_path, runner, text, name).startswith("started: ")
        assert runner.job.process.wait(timeout=600) == 0, runner.job.log_tail(40)
    finally:
        if runner.job is not None and runner.job.running():
            runner.job.process.kill()
    assert runner.job.outcome() == f"finished: 3 steps; the model is in runs/quickstart-{method}"
    _, loss, headline, *_ = job_view(tmp_path, runner)

    history = json.loads((tmp_path / "runs" / f"quickstart-{method}" / "trainer_state.json").read_text())["log_history"]
    logged = [h for h in history if "loss" in h]
    assert [h["step"] for h in logged] == [1, 2, 3]
    assert loss["value"].tolist() == [h["loss"] for h in logged]
    frame = headline["value"]
    keys = [k for k in headline_keys(method, {k for h in logged for k in h}) if not k.startswith("eval_")]
    if method == "grpo":  # TRL logs kl only with beta > 0 (the quick start: 0)
        keys.remove("kl")
    expected = [(h["step"], h[k], k) for h in logged for k in keys if k in h]
    assert list(frame.itertuples(index=False, name=None)) == expected
    if method == "pt":
        assert expected == [] and headline["visible"] is False
    else:
        assert headline["visible"] is True and {k for _, _, k in expected} == set(keys)
        if method == "grpo":  # the mean reward, each reward function's (exact_answer, the recipe's digits), the length
            assert set(keys) == {"reward", "rewards/exact_answer/mean", "rewards/digits/mean", "completions/mean_length"}
        assert all(math.isfinite(v) for _, v, _ in expected)
        accuracies = [v for _, v, k in expected if k in ("rewards/accuracies", "accuracy")]
        assert all(0 <= v <= 1 for v in accuracies) and len(accuracies) == (0 if method in ("kto", "grpo") else 3)
    # loss.png, written as training ends, draws the same curves: the loss, then each headline metric
    run = tmp_path / "runs" / f"quickstart-{method}"
    assert (run / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert panels(history) == [("loss", {"train": [(h["step"], h["loss"]) for h in logged]})] + [
        (k, {"train": [(step, v) for step, v, key in expected if key == k]}) for k in keys]
