"""A weight EMA instead of a decaying learning rate (`train.ema: {decay: D, start: S}`), as the ERNIE 4.5 report trains.

After each optimizer step past step S the EMA of every trained parameter (LoRA: the adapters; full fine-tuning: the
model, one fp32 copy) moves towards it, e ← D·e + (1 − D)·p, on the device with `torch._foreach_mul_`/`_add_` and no
host read; until step S it is the parameter itself. It is saved in every checkpoint (`ema.safetensors`, written in
the checkpoint's staging dir, so a checkpoint holds it or does not exist) and restored exactly on resume. At the end
`OUTPUT/ema/` is a run dir of the same format with the EMA weights in place of the trained ones (an adapter folder or
a model folder, the tokenizer, recipe.yaml, and metrics of the EMA weights: the EMA evaluated on the run's eval data,
if it has any, and no loss curve, which the trained weights made), which `chat`, `merge`, `eval`, `export` and `push`
take as a path. Parameters sharded across processes (FSDP, ZeRO-3) are refused before training: gathering them
every step is what the EMA must not cost.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import TrainerCallback

FILE = "ema.safetensors"
DIR = "ema"
COPIED = ("recipe.yaml", "generation_config.json")  # beside the weights, as the run has them
# train_results.json keys that describe how the weights were made, not what the trained weights measured
RUN_FACTS = ("distributed", "epoch", "total_flos", "train_runtime", "train_samples", "train_samples_per_second",
             "train_steps_per_second", "train_tokens", "train_tokens_per_second", "packing_efficiency")


def setup(trainer, plan, log=print) -> WeightEma | None:
    """`train.ema`: the callback on the trainer (`trainer.ema`, which the checkpoints and the final save read)."""
    settings = plan.ema
    if not settings:
        return None  # FSDP and ZeRO-3 were refused with it by the run plan (`run_plan.refuse_unlaunchable`)
    ema = WeightEma(settings["decay"], settings["start"])
    # local SGD: each process keeps the EMA of its own parameters; their mean, taken when the EMA is saved, is the EMA
    # of the processes' mean parameters (the EMA is linear), the model every process holds at each averaging
    ema.across = plan.sync.sync == "local_sgd" and trainer.accelerator.num_processes > 1
    trainer.ema = ema
    trainer.add_callback(ema)
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    log(f"ema: decay {ema.decay:g} from step {ema.start}, an fp32 copy of the {trained:,} trained parameters "
        f"({trained * 4 / 2**20:,.1f} MiB), in every checkpoint; {plan.out / DIR} at the end (train.ema)")
    return ema


class WeightEma(TrainerCallback):
    def __init__(self, decay: float, start: int):
        self.decay, self.start = decay, start
        self.names: list[str] = []
        self.params: list[torch.Tensor] = []
        self.ema: list[torch.Tensor] = []
        self.resume: Path | None = None  # the checkpoint training resumes from (callbacks.train sets it)
        self.across = False  # local SGD: the processes' EMAs differ until `agree` (setup)

    def attach(self, model) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        with torch.no_grad():
            self.ema = [p.detach().float().clone() for p in self.params]

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.attach(model)
        if self.resume is not None:
            self.load(self.resume)

    def on_step_end(self, args, state, control, **kwargs):
        # d·e + (1 − d)·p, not `_foreach_lerp_`: lerp wants p in fp32 too, an fp32 copy of a bf16 model every step
        current = [p.detach() for p in self.params]
        with torch.no_grad():
            if state.global_step <= self.start:
                torch._foreach_copy_(self.ema, current)
            else:
                torch._foreach_mul_(self.ema, self.decay)
                torch._foreach_add_(self.ema, current, alpha=1.0 - self.decay)

    def agree(self) -> None:
        """Under local SGD, every process's EMA replaced by their mean: the EMA of the mean parameters. Collective:
        every process calls it where the EMA is saved (a checkpoint, OUTPUT/ema); a no-op otherwise."""
        if self.across:
            from erniekit_lite.train.sync import average

            average(self.ema)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: value.contiguous() for name, value in zip(self.names, self.ema)}

    def save(self, checkpoint: Path) -> None:
        from safetensors.torch import save_file

        from erniekit_lite.files import for_user

        save_file({n: t.cpu() for n, t in self.state_dict().items()}, str(Path(checkpoint) / FILE))
        for_user(Path(checkpoint) / FILE)  # safetensors writes 0600; the rest of the checkpoint follows the umask

    def load(self, checkpoint: Path) -> None:
        from safetensors.torch import load_file

        from erniekit_lite.errors import UserError

        file = Path(checkpoint) / FILE
        if not file.is_file():
            raise UserError(f"{checkpoint}: no {FILE}; this checkpoint was saved without train.ema")
        saved = load_file(str(file))
        if sorted(saved) != sorted(self.names):
            raise UserError(f"{file}: its parameters are not the ones this run trains")
        with torch.no_grad():
            for name, value in zip(self.names, self.ema):
                value.copy_(saved[name])

    def write_run(self, trainer, out: Path, metrics: dict) -> Path:
        """OUTPUT/ema: the trained parameters swapped for their EMA while the model is saved (and evaluated, when the
        run has eval data), then swapped back. Its metrics describe the EMA weights only: the run's facts (steps,
        tokens, time), the EMA's settings and its own eval metrics; not the trained weights' losses or loss curve."""
        target = Path(out) / DIR
        self.agree()
        kept = [p.detach().to("cpu", copy=True) for p in self.params]
        with torch.no_grad():
            for p, e in zip(self.params, self.ema):
                p.copy_(e)
        try:
            trainer.save_model(str(target))
            evaluated = {}
            if trainer.eval_dataset is not None:  # every process takes part, as in the run's own evaluation
                evaluated = trainer.evaluation_loop(trainer.get_eval_dataloader(), description="Evaluation of the EMA",
                                                    prediction_loss_only=True, metric_key_prefix="eval").metrics
        finally:
            with torch.no_grad():
                for p, k in zip(self.params, kept):
                    p.copy_(k)
        if trainer.is_world_process_zero():
            for name in COPIED:
                if (Path(out) / name).is_file():
                    shutil.copy2(Path(out) / name, target / name)
            results = {**{k: v for k, v in metrics.items() if k in RUN_FACTS}, "ema_decay": self.decay,
                       "ema_start": self.start, **{k: v for k, v in evaluated.items() if k.startswith("eval_")}}
            (target / "train_results.json").write_text(json.dumps(results, indent=4, sort_keys=True) + "\n")
            state = json.loads((Path(out) / "trainer_state.json").read_text())
            (target / "trainer_state.json").write_text(json.dumps({**state, "log_history": []}, indent=2, sort_keys=True) + "\n")
        return target
