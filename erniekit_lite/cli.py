"""`erniekit-lite` command line. Each subcommand parses its arguments and calls one function.

Heavy libraries (torch, transformers, TRL) are imported inside the handlers so `--help` stays instant.
"""

from __future__ import annotations

import argparse
import os
import sys

from erniekit_lite import __version__
from erniekit_lite.errors import Stopped, UserError


def passive_cpu_threads() -> None:
    """OpenMP's idle threads sleep instead of spinning (`OMP_WAIT_POLICY=PASSIVE`) unless the environment says otherwise:
    on 2 cores busy with other jobs the quick start took 43.7 s with torch's spinning threads and 26.6 s with passive
    ones, and idle as long either way (16.5 s vs 16.6 s; medians of 3, `benchmarks/results-threads.txt`). Read by
    OpenMP when torch loads, so set before anything imports torch; launched workers inherit it."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


class _Parser(argparse.ArgumentParser):
    """argparse's refusals as every other: one line on stderr, exit status 2, with a did-you-mean for a choice (its
    own prints the usage first, three lines and more)."""

    def error(self, message: str):
        import difflib
        import re

        choice = re.match(r"argument (\S+): invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            options = re.findall(r"'([^']*)'", choice.group(3)) or [o.strip() for o in choice.group(3).split(",")]
            close = difflib.get_close_matches(choice.group(2), options, n=1)
            message += f"; did you mean '{close[0]}'?" if close else ""
        self.exit(2, f"error: {self.prog}: {message} (`{self.prog} --help` says more)\n")


def main(argv: list[str] | None = None) -> int:
    passive_cpu_threads()
    parser = _Parser(prog="erniekit-lite", description="Fine-tune ERNIE 4.5 from YAML recipes.")
    parser.add_argument("--version", action="version", version=f"erniekit-lite {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train from a recipe")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. train.learning_rate=2e-5")
    p.add_argument("--num-processes", type=int, metavar="N", help="train on N devices: re-run under `accelerate launch` with N processes")
    p.add_argument("--accelerate-config", metavar="FILE", help="launch with this accelerate config (FSDP, DeepSpeed; see recipes/accelerate/)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in output.dir (none: start from scratch)")
    m = p.add_argument_group("more than one machine (run the same command on each; --num-processes is the total over all)")
    m.add_argument("--num-machines", type=int, metavar="N", help="machines taking part")
    m.add_argument("--machine-rank", type=int, metavar="R", help="this machine's rank, 0 to N-1 (machine 0 hosts the rendezvous)")
    m.add_argument("--main-process-ip", metavar="HOST", help="address of machine 0, reachable from every machine")
    m.add_argument("--main-process-port", type=int, metavar="P", help="rendezvous port on machine 0 (default 29500)")
    m.add_argument("--join-timeout", type=int, metavar="S", help="seconds to wait for every machine to join (default 120)")
    p.set_defaults(handler=_train)

    p = sub.add_parser("recipes", help="list the shipped recipes (usable by name: `erniekit-lite train quickstart`), or copy them out to edit")
    p.add_argument("--copy", metavar="DIR", help="copy every shipped recipe and its demo data to DIR/recipes (nothing is overwritten)")
    p.set_defaults(handler=_recipes)

    p = sub.add_parser("validate", help="check a recipe and its data, print the plan, train nothing")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--num-processes", type=int, help="as `train` takes it: the processes the run would be launched with")
    p.add_argument("--accelerate-config", help="as `train` takes it: FSDP or DeepSpeed, checked and planned sharded")
    p.set_defaults(handler=_validate)

    p = sub.add_parser("chat", help="chat with a model, a run's output dir, or a base + --adapter (streamed)")
    p.add_argument("path", help="Hub id, model dir, or output dir (an adapter dir loads its base)")
    p.add_argument("--adapter", help="a LoRA output dir to apply on PATH")
    p.add_argument("--prompt", help="answer this one prompt and exit (otherwise interactive)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="with --prompt: show this image too (ERNIE-4.5-VL models; repeat for several)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (deterministic)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.set_defaults(handler=_chat)

    p = sub.add_parser("merge", help="merge a LoRA output dir into its base: a plain transformers checkpoint")
    p.add_argument("output_dir", help="a LoRA run's output dir")
    p.add_argument("--out", required=True, help="new directory for the merged model")
    p.add_argument("--overwrite", action="store_true", help="allow a non-empty --out")
    p.set_defaults(handler=_merge)

    p = sub.add_parser("prune", help="a model cut to the experts (MoE) and/or decoder layers your data uses most: a smaller standard checkpoint")
    p.add_argument("source", metavar="RUN_OR_MODEL", help="a run's output dir (LoRA: merged first) or an ERNIE 4.5 MoE model dir or Hub id")
    p.add_argument("--experts", type=int, metavar="K", help="experts kept per MoE layer: those carrying the most routing weight")
    p.add_argument("--layers", type=int, metavar="L", help="decoder layers kept: those that change the hidden states most on the data (dense or MoE)")
    p.add_argument("--out", required=True, help="new directory for the pruned model")
    p.add_argument("--data", metavar="FILE", help="data to measure routing on (default for a run: its training data; a model needs it)")
    p.add_argument("--top-k", type=int, metavar="N", help="experts each token picks in the pruned model (default: the model's moe_k)")
    p.add_argument("--report", metavar="GRID", help='held-out loss of the original and of each cut of a grid, e.g. "layers=24,20 experts=32,16 '
                   'top-k=6,4" (K1,K2,... alone: experts): OUT.report.md and OUT.report.png')
    p.add_argument("--eval", metavar="FILE", help="held-out data for --report (default: the run's data.eval or data.eval_split)")
    p.add_argument("--batch-size", type=int, default=8, help="packed rows per scoring forward")
    p.add_argument("--overwrite", action="store_true", help="allow replacing a previous prune in --out")
    p.set_defaults(handler=_prune)

    p = sub.add_parser("push", help="upload a finished run to the Hugging Face Hub, with a model card and loss plot")
    p.add_argument("output_dir", help="a finished run's output dir")
    p.add_argument("--repo", required=True, metavar="USER/NAME", help="repository to push to (created if missing)")
    public = p.add_mutually_exclusive_group()
    public.add_argument("--public", action="store_true", help="create the repository as public (default: private)")
    public.add_argument("--private", action="store_true", help="private, and refuse an existing public repository (default: a new repository is private, an existing one kept as it is)")
    p.add_argument("--merged", action="store_true", help="LoRA runs: push the adapter merged into its base")
    p.add_argument("--revision", metavar="BRANCH", help="push to this branch (created from main if missing)")
    p.add_argument("--ema", action="store_true", help="push the run's weight EMA (OUTPUT/ema, written with train.ema) instead")
    p.set_defaults(handler=_push)

    p = sub.add_parser("eval", help="--tasks: benchmarks through lm-evaluation-harness (MMLU, C-Eval, GSM8K, ...); --data: loss and perplexity on a data file")
    p.add_argument("target", metavar="TARGET", help="a run output dir, a model dir, a Hub id, or (with --data) a recipe .yaml")
    p.add_argument("--data", metavar="FILE", help="data file in any training format (auto-detected): loss and perplexity")
    p.add_argument("--generate", action="store_true", help="with --data: also answer each record's last user turn, written as JSONL "
                   "(with --out FILE: FILE holds the answers, and the metrics go beside it, FILE's suffix replaced by .metrics.json: "
                   "answers.jsonl -> answers.metrics.json)")
    p.add_argument("--tasks", metavar="NAMES", help="comma-separated lm-eval tasks, groups or tags, e.g. mmlu,cmmlu,ceval-valid,gsm8k")
    p.add_argument("--tasks-path", metavar="DIR", help="also read lm-eval task YAMLs from DIR (local data: how it runs offline)")
    p.add_argument("--num-fewshot", type=int, metavar="K", help="few-shot examples per prompt (default: each task's own)")
    p.add_argument("--limit", type=float, metavar="N", help="with --tasks: the first N examples of each task (below 1: that fraction)")
    p.add_argument("--chat", action="store_true", help="with --tasks: render each request with the model's chat template")
    p.add_argument("--compare", metavar="BASE", help="with --tasks: evaluate BASE too and print base, tuned and the difference")
    p.add_argument("--adapter", help="with --tasks: a LoRA output dir to apply on TARGET")
    p.add_argument("--out", metavar="FILE", help="where the results go: the metrics (--data) or results (--tasks) JSON; with --generate, the answers "
                   "JSONL, the metrics beside it. Default: the folder of the model evaluated (the run's output dir, a model dir, a "
                   "recipe's model.path; with --adapter, the adapter's), as eval/eval_results[-N].json and eval/eval_generations[-N].jsonl "
                   "(new numbers, never over earlier files; never the working folder: a Hub id needs --out)")
    p.add_argument("--overwrite", action="store_true", help="allow replacing an existing --out (and, with --generate, the metrics file beside it)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8, help="packed rows per scoring forward, prompts per generation batch")
    p.add_argument("--max-samples", type=int, metavar="N", help="only the first N records (--data) or examples per task (--tasks, as --limit)")
    p.set_defaults(handler=_eval)

    p = sub.add_parser("export", help="a GGUF for llama.cpp / Ollama, made by llama.cpp's own converter and quantizer (LoRA runs merged first)")
    p.add_argument("run", help="a finished run's output dir (LoRA or full) or a model dir")
    p.add_argument("--to", default="gguf", help="gguf (the only format)")
    p.add_argument("--outtype", default="f16", help="f32, f16, bf16, q8_0 (the converter) or q4_k_m, q5_k_m, q6_k, ... (llama.cpp's quantizer)")
    p.add_argument("--out", required=True, help="new directory for the GGUF (and the Modelfile)")
    p.add_argument("--ollama", action="store_true", help="also write an Ollama Modelfile: the ERNIE template, stop tokens, system prompt")
    p.add_argument("--llama-cpp", metavar="DIR", help="a llama.cpp checkout or an unpacked llama-cpp-python sdist (default: $LLAMA_CPP_DIR)")
    p.add_argument("--overwrite", action="store_true", help="allow replacing a previous export in --out")
    p.set_defaults(handler=_export)

    p = sub.add_parser("serve", help="an OpenAI-compatible server for a run (vLLM or `transformers serve`); LoRA runs merged once")
    p.add_argument("run", help="a run output dir (LoRA: merged once into RUN.merged), a model dir or a Hub id")
    p.add_argument("--engine", choices=["auto", "vllm", "transformers"], default="auto", help="auto: vLLM when its executable is found, else transformers")
    p.add_argument("--vllm", metavar="PATH", help="the `vllm` executable (or its venv dir): vLLM pins an older transformers, so it lives in its own environment")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every network interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("engine_args", nargs="*", metavar="-- ENGINE ARGS",
                   help="passed to the engine as they are, after `--` (vLLM: -- --max-model-len 4096 --dtype bfloat16)")
    p.set_defaults(handler=_serve)

    p = sub.add_parser("tiny", help="write a small random ERNIE 4.5 checkpoint (offline demos and tests)")
    p.add_argument("out_dir")
    p.add_argument("--arch", choices=["dense", "moe", "vl"], default="dense",
                   help="vl: the vision-language MoE (ERNIE-4.5-VL-28B-A3B's architecture), with its image processor")
    p.add_argument("--tokenizer", help="copy this tokenizer in, from a folder or a Hub id (e.g. the real ERNIE 4.5 one, with the tokenizer.model a GGUF export reads); default: a small built-in one")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--released-shape", action="store_true", help="the released architecture's size (0.3B / 21B-A3B), random weights")
    p.set_defaults(handler=_tiny)

    p = sub.add_parser("webui", help="browser UI: edit a recipe, train with live progress, chat, merge, push")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (0.0.0.0: every network interface)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="also serve through a public gradio.live link")
    p.add_argument("--auth", metavar="USER:PASSWORD", help="require this login (default: $ERNIEKIT_WEBUI_AUTH, else none)")
    p.add_argument("--llama-cpp", metavar="DIR", help="llama.cpp for the Export tab's GGUF (default: $LLAMA_CPP_DIR); pages never name it")
    p.set_defaults(handler=_webui)

    args = _parse(parser, sub, sys.argv[1:] if argv is None else argv)
    if not sys.stderr.isatty():  # a log file or the web UI's log pane: tqdm's redraws are noise there
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' and the Hub's bars read it at import
        if "transformers" in sys.modules:  # imported already (in-process callers): its switch instead
            sys.modules["transformers"].utils.logging.disable_progress_bar()
    try:
        code = args.handler(args) or 0
        sys.stdout.flush()  # here, not at exit: a closed pipe is then caught below
        return code
    except UserError as e:
        # one write of the whole line: the processes of a launched run share stderr, and print's two writes (text,
        # then newline) interleaved there, joining two processes' errors on one line
        sys.stderr.write(f"error: {e}\n")
        sys.stderr.flush()
        return 2
    except Stopped as e:
        if os.environ.get("RANK", "0") == "0":  # every process of a launched run stops; one says so
            print(str(e), file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `erniekit-lite recipes | head`: the reader left; the rest goes nowhere, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _parse(parser, sub, argv: list[str]) -> argparse.Namespace:
    """Options and `key=value` overrides in any order (`train r.yaml --resume train.max_steps=12`): each subcommand
    parses its own arguments intermixed (argparse refuses that for a parser with subcommands)."""
    if not argv or argv[0].startswith("-") or argv[0] not in sub.choices:
        return parser.parse_args(argv)  # --help, or argparse's own error naming the commands
    args = sub.choices[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


def _recipes(args) -> int:
    from erniekit_lite import shipped

    if args.copy:
        print(f"copied to {shipped.copy_to(args.copy)}; run the commands from {args.copy} (recipes/... paths)")
        return 0
    names = shipped.names()
    width = max(map(len, names))
    for name in names:
        print(f"{name:<{width}}  {shipped.summary(name)}")
    return 0


def _train(args) -> int:
    from erniekit_lite import recipe as recipes

    overrides = list(args.overrides)
    if args.resume:
        if any(o.startswith("train.resume_from_checkpoint=") for o in overrides):
            raise UserError("--resume and train.resume_from_checkpoint=... both given; use one")
        overrides.append("train.resume_from_checkpoint=auto")  # resolved when training starts
    r = recipes.load(args.recipe, overrides)
    from erniekit_lite.launch import Machines

    machines = Machines(args.num_machines, args.machine_rank, args.main_process_ip, args.main_process_port, args.join_timeout)
    # FSDP2's CPU offload runs launched, one process or more; a launched worker (LOCAL_RANK set) trains
    parameters = recipes.own_train(r, "offload") == "parameters" and "LOCAL_RANK" not in os.environ
    launching = args.num_processes is not None or args.accelerate_config is not None or machines.given() or parameters
    from erniekit_lite.train import run_lock

    # The run holds its folder from here, before anything heavy loads: a second train into it is refused in one line
    # naming this process (with several machines, machine 0's command holds it; launched processes leave it to theirs)
    rank = machines.machine_rank
    if launching and rank is None and args.accelerate_config is not None:
        from erniekit_lite.launch import _read_config

        try:
            rank = _read_config(args.accelerate_config).get("machine_rank")
        except UserError:  # said where the launch reads it, in its turn
            pass
    with run_lock.hold(r.output.dir, run_lock.takes(rank if launching else None),
                       log=lambda line: print(line, file=sys.stderr)):
        return _train_holding(args, r, overrides, machines, parameters, launching)


def _train_holding(args, r, overrides: list[str], machines, parameters: bool, launching: bool) -> int:
    if launching:
        from erniekit_lite.launch import launch, launch_of
        from erniekit_lite.run_plan import refuse_unlaunchable
        from erniekit_lite.train import rundir

        # said once, before any process starts (each would say it, then torch its traceback)
        refuse_unlaunchable(r, launch_of(args.num_processes, args.accelerate_config, parameters))
        if not machines.given():  # on several machines each has its own paths, checked by its own workers
            _answer_early(r)
        rundir.check(rundir.target(r))
        return launch(args.recipe, overrides, args.num_processes, args.accelerate_config, machines, parameters)
    if "LOCAL_RANK" not in os.environ:  # answered before torch loads (the run checks the output folder again)
        from erniekit_lite.train import rundir

        _answer_early(r)
        rundir.check(rundir.target(r))
    _quiet_libraries()
    from erniekit_lite.launch import begin_process_group, end_process_group, print_on_main
    from erniekit_lite.train import method_runner

    begin_process_group()
    try:
        method_runner(r.method)(r, log=print_on_main)
    except Stopped as e:
        code, message = e.code, str(e)
    else:
        end_process_group()
        return 0
    # A stop's workers exit too, and gloo's threads left to exit sometimes aborted one. Freed out of the handler: its
    # traceback held the run's frames, the trainer and its DDP wrapper among them, which hold the group
    end_process_group(wait=False)
    raise Stopped(code, message)


def _answer_early(r) -> None:
    """What needs no model, said before anything heavy loads: a path typo at its recipe line, a sequence_parallel the
    model's heads do not take (its config.json read as JSON)."""
    from erniekit_lite import recipe as recipes
    from erniekit_lite.run_plan import early_checks

    recipes.check_local_paths(r)
    early_checks(r)


def _validate(args) -> int:
    from erniekit_lite import recipe as recipes

    r = recipes.load(args.recipe, args.overrides)
    from erniekit_lite.launch import launch_of
    from erniekit_lite.run_plan import refuse_unlaunchable

    parameters = recipes.own_train(r, "offload") == "parameters"  # `train` launches FSDP2 for it
    launch = launch_of(args.num_processes, args.accelerate_config, parameters)
    refuse_unlaunchable(r, launch)  # what `train` would refuse before starting a process
    _answer_early(r)
    _quiet_libraries()
    from erniekit_lite.plan import plan

    info = plan(r, launch=launch)
    print(f"{args.recipe}: valid" + ("" if info["data_read"] else " (the data was not read: no tokenizer)"))
    return 0


def _chat(args) -> int:
    from erniekit_lite.chat import chat, image_processor_of, load, reply, sampling_settings

    sampling = sampling_settings(args.max_new_tokens, args.temperature, args.top_p)
    if args.image and args.prompt is None:
        raise UserError("--image goes with --prompt (in interactive chat: /image FILE)")
    _quiet_libraries()
    model, tokenizer = load(args.path, args.adapter)
    processor = image_processor_of(model, args.path, args.adapter)
    if args.prompt is not None:
        if processor is not None and not args.image:
            from erniekit_lite.chat import NO_IMAGE

            print(f"note: {NO_IMAGE} (--image FILE shows one)", file=sys.stderr)
        reply(model, tokenizer, args.prompt, args.system, [], images=args.image, processor=processor, **sampling)
    else:
        chat(model, tokenizer, args.system, processor=processor, **sampling)
    return 0


def _merge(args) -> int:
    _quiet_libraries()
    from erniekit_lite.model.merge import merge

    from erniekit_lite.model.reward import is_reward_run

    out = merge(args.output_dir, args.out, args.overwrite)
    from erniekit_lite.model.vl import model_class

    loads = ("AutoModelForSequenceClassification.from_pretrained({!r}) once erniekit_lite.model.reward is imported"
             if is_reward_run(str(out)) else model_class(str(out)).__name__ + ".from_pretrained({!r})")
    print(f"merged {args.output_dir} into {out}: loads with {loads.format(str(out))}")
    return 0


def _prune(args) -> int:
    _quiet_libraries()
    from erniekit_lite.prune import prune

    prune(args.source, args.experts, args.out, args.data, args.top_k, args.report, args.eval, args.overwrite, args.batch_size,
          args.layers)
    return 0


def _push(args) -> int:
    _quiet_libraries()
    from erniekit_lite.hub import push, settings

    run = args.output_dir
    if args.ema:
        from pathlib import Path

        run = str(Path(args.output_dir) / "ema")
        if not (Path(run) / "recipe.yaml").is_file():
            raise UserError(f"{args.output_dir}: no finished weight EMA in it ({run}); train with train.ema to write one")
    push(run, settings(args.repo, True if args.private else False if args.public else None, args.merged, args.revision))
    return 0


def _eval(args) -> int:
    if (args.data is None) == (args.tasks is None):
        raise UserError("eval: give --tasks NAMES (lm-eval benchmarks) or --data FILE (loss and perplexity), one of them")
    _quiet_libraries()
    if args.tasks is not None:
        if args.generate:
            raise UserError("eval: --generate goes with --data; lm-eval's generation tasks (gsm8k, ...) generate by themselves")
        if args.limit is not None and args.max_samples is not None:
            raise UserError("eval: --limit and --max-samples are one setting; give one")
        from erniekit_lite.evaluate import result_files
        from erniekit_lite.tasks import run_tasks

        limit = args.limit if args.limit is not None else args.max_samples
        out, _ = result_files(args.out, False, args.overwrite, args.adapter or args.target)  # checked before lm-eval runs
        run_tasks(args.target, args.tasks.split(","), args.adapter, args.tasks_path, args.num_fewshot, limit,
                  args.batch_size, args.chat, args.compare, str(out))
        return 0
    given = [flag for flag, value in (("--tasks-path", args.tasks_path), ("--num-fewshot", args.num_fewshot), ("--limit", args.limit),
                                      ("--chat", args.chat or None), ("--compare", args.compare), ("--adapter", args.adapter)) if value is not None]
    if given:
        raise UserError(f"eval: {', '.join(given)} go{'es' if len(given) == 1 else ''} with --tasks, not --data")
    from erniekit_lite.evaluate import evaluate

    evaluate(args.target, args.data, args.out, args.generate, args.max_new_tokens, args.batch_size, args.max_samples,
             overwrite=args.overwrite)
    return 0


def _export(args) -> int:
    _quiet_libraries()
    from erniekit_lite.export import export

    export(args.run, args.to, args.out, args.outtype, args.ollama, args.llama_cpp, args.overwrite)
    return 0


def _serve(args) -> int:
    _quiet_libraries()
    from erniekit_lite.serve import serve

    serve(args.run, args.engine, args.host, args.port, args.vllm, args.engine_args)
    return 0


def _tiny(args) -> int:
    _quiet_libraries()
    from erniekit_lite.tiny import write_tiny

    from pathlib import Path

    existed = (Path(args.out_dir) / "erniekit_tiny.json").is_file()
    out = write_tiny(args.out_dir, args.arch, args.tokenizer, args.hidden_size, args.layers, args.seed, args.released_shape)
    print(f"{'kept the' if existed else 'wrote a'} tiny {args.arch} ERNIE 4.5 checkpoint {'already in' if existed else 'to'} {out}")
    return 0


def _webui(args) -> int:
    _quiet_libraries()
    from erniekit_lite.webui.app import launch

    launch(args.host, args.port, args.share, args.auth or os.environ.get("ERNIEKIT_WEBUI_AUTH"), args.llama_cpp)
    return 0


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
