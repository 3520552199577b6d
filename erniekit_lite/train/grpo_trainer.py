"""TRL's GRPOTrainer with ERNIE rendering and packed completion scoring.

TRL's: generation (transformers' `generate`, or vLLM through `train.use_vllm` / `vllm_mode: server`), the reward
calls and their weighting, group advantages, the reference (the base with the adapter disabled for a new LoRA
adapter; a frozen copy for full fine-tuning; none at `beta: 0`), the whole loss (`_compute_loss`: grpo, dapo,
dr_grpo, bnpo, cispo, sapo, ...), its metrics and the training loop.

Ours, two narrow overrides of the computation:
- `_tokenize_prompts`: each prompt (chat messages) is rendered by erniekit-lite's template as training renders one
  (`data/prompts.prompt_ids`), not by the tokenizer's `apply_chat_template`: ERNIE's generation prompt ends in the
  token `▁` and user text never becomes a control token;
- `_get_per_token_logps_and_entropies`: every scoring pass (policy with grad, old policy, reference) runs the
  batch's sequences as one packed row with per-sample attention and the LM head only at completion positions
  (grpo_scoring.py), returning TRL's [B, C] layout, so `_compute_loss` reads what it always reads.
Generation itself is TRL's; a model loaded with a packed attention (`packed_sdpa` / `packed_varlen`, which ignore
padding) generates its left-padded batches under plain sdpa and switches back for scoring.

And two of resuming, what TRL 1.16 leaves out of a checkpoint, so that a resumed run trains as the uninterrupted
one did (tests/test_grpo_resume.py):
- the prompt order of epoch e: TRL's `RepeatSampler` draws each epoch's permutation from one seeded generator, and a
  resumed run's fresh sampler would start again at epoch 0's (`EpochRepeatSampler.set_epoch`);
- the generation cycle: TRL generates for `steps_per_generation` x `num_iterations` micro-steps at once, buffers the
  completions and counts micro-steps from 0 in each process; a run resumed inside a cycle would regenerate there and
  then generate off the cycle. The count and, inside a cycle, the buffer are saved beside the RNG state
  (`grpo_generation_state_<process>.pt`) and restored with it.
"""

from __future__ import annotations

import contextlib
import os

import torch
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler

from erniekit_lite.data.prompts import prompt_ids, prompt_text
from erniekit_lite.data.template import template_for
from erniekit_lite.data.tokenize import Tokenizer
from erniekit_lite.model.attention import PACKED
from erniekit_lite.model.lora import unwrap
from erniekit_lite.train import scored
from erniekit_lite.train.grpo_scoring import MARK, check_head, packed_inputs, to_layout
from erniekit_lite.train.step import ErnieTrainer

GENERATION_STATE = "grpo_generation_state_{}.pt"  # in a checkpoint, per process index


def _inner(model):
    """The causal LM under PEFT and accelerate wrappers (its modules hold any adapters)."""
    model = getattr(model, "module", model)
    return unwrap(model)


class ErnieGRPOTrainer(ErnieTrainer, GRPOTrainer):
    packed_scoring = True  # False (data.packing: false): TRL's own padded scoring (the parity tests compare the two)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._render = Tokenizer(self.processing_class, template_for(self.processing_class))
        check_head(_inner(self.model))
        # Our forward under TRL's fused head (which stays for TRL's own padded path): a policy loaded for training has
        # our class already (TRL's head wraps it); a reference TRL built from the path gets it, and TRL's head again
        head = {"temperature": self.temperature, "cast_lm_head_to_fp32": self.args.cast_lm_head_to_fp32}
        _score_under_trl_head(_inner(self.model), outputs=("log_probs", "entropy"), **head)
        if self.ref_model is not None:
            _score_under_trl_head(self.ref_model, **head)

    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        sampler.__class__ = EpochRepeatSampler  # TRL's sampler as TRL built it, plus set_epoch
        return sampler

    def _save_rng_state(self, output_dir) -> None:
        super()._save_rng_state(output_dir)  # every process, into the checkpoint being written
        inside_cycle = self._step % (self.args.steps_per_generation * self.num_iterations) != 0
        state = {"step": self._step, "buffered_inputs": self._buffered_inputs if inside_cycle else None}
        torch.save(state, f"{output_dir}/{GENERATION_STATE.format(self.args.process_index)}")

    def _load_rng_state(self, checkpoint) -> None:
        # transformers calls this once on resume, at the checkpoint's step, just before the next micro-step
        super()._load_rng_state(checkpoint)
        path = f"{checkpoint}/{GENERATION_STATE.format(self.args.process_index)}"
        if checkpoint is not None and os.path.isfile(path):
            state = torch.load(path, map_location=self.accelerator.device, weights_only=True)
            self._step, self._buffered_inputs = state["step"], state["buffered_inputs"]

    def _tokenize_prompts(self, prompts: list):
        return [prompt_ids(self._render, messages) for messages in prompts], None, {}

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # every reward function also gets `prompt_text`: the prompt as rendered for generation (rewards.py)
        inputs = [{**x, "prompt_text": prompt_text(self._render, x["prompt"])} for x in inputs]
        return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

    def _generate_single_turn(self, *args, **kwargs):
        with plain_attention(_inner(self.model)):
            return super()._generate_single_turn(*args, **kwargs)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        if not self.packed_scoring:  # TRL's padded rows need an attention that reads their mask
            with plain_attention(_inner(model)):
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **multimodal)
        if any(v is not None for v in multimodal.values()):
            raise ValueError("erniekit-lite's GRPO scores text only")
        batch_size = batch_size or input_ids.size(0)
        logps, entropies, aux = [], [], []
        for start in range(0, input_ids.size(0), batch_size):  # TRL's chunks, each one packed row
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            packed = packed_inputs(ids, mask, logits_to_keep)
            real = int(mask.sum())
            self.count_tokens(model, real, real)  # one packed row holds exactly the real tokens: no padding
            with self.accelerator.autocast():
                out = model(**packed, temperature=self.temperature, entropy=compute_entropy, aux=compute_aux_loss,
                            **{MARK: True})
            logps.append(to_layout(out["log_probs"], mask, logits_to_keep))
            if compute_entropy:
                entropies.append(to_layout(out["entropy"], mask, logits_to_keep))
            if compute_aux_loss:
                aux.append(out["aux_loss"])
        return (torch.cat(logps), torch.cat(entropies) if compute_entropy else None,
                torch.stack(aux).mean() if compute_aux_loss else None)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        read_back(self._metrics.values())  # before TRL's `log` averages them: one transfer
        super().log(logs, start_time)

    def count_tokens(self, model, real: int, slots: int) -> None:
        # TRL's `_generate` already adds prompt + completion tokens to num_input_tokens_seen: only the throughput
        # counters (tokens scored with grad, per second) are kept here
        if torch.is_grad_enabled():
            seen = self.state.num_input_tokens_seen
            super().count_tokens(model, real, slots)
            self.state.num_input_tokens_seen = seen


def _score_under_trl_head(model, **head) -> None:
    """`model` scores GRPO's packed batches in its forward (train/scored.py) with TRL's fused head around it, as
    TRL's `__init__` put it (`add_fused_lm_head(model, **head)`)."""
    if getattr(type(model), scored.SCORED, False):
        return  # its class was ours before TRL's head went on: the head wraps our forward
    from trl.trainer.utils import add_fused_lm_head

    scored.without_trl_head(model)
    scored.take(model)
    add_fused_lm_head(model, **head)


@contextlib.contextmanager
def plain_attention(model):
    """sdpa while the block runs when the model uses a packed attention (it reads no padding mask)."""
    current = model.config._attn_implementation
    if current not in PACKED:
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(current)


class EpochRepeatSampler(RepeatSampler):
    """TRL's `RepeatSampler` with epoch e's order drawn from the seed alone: the (e + 1)-th permutation of the seeded
    generator, the order an uninterrupted run takes, also in a resumed run's new sampler (accelerate and transformers
    call `set_epoch` before each epoch's iteration)."""

    def set_epoch(self, epoch: int) -> None:
        if not self.shuffle or self.seed is None:
            return
        self.generator.manual_seed(self.seed)
        for _ in range(epoch):
            torch.randperm(self.num_samples, generator=self.generator)


def read_back(kept) -> None:
    """The project's metrics kept as device tensors in TRL's metric lists (`kept`: metric name -> list of values per
    mode) between logging steps (a `.item()` per micro-batch stalled the GPU each time), replaced by Python numbers:
    one transfer per kind. Counts come back as integers: through float32 they are exact only below 2^24."""
    held = [(values, i) for metrics in kept for values in metrics.values() for i, v in enumerate(values) if torch.is_tensor(v)]
    parts = {kind: [(values, i) for values, i in held if values[i].is_floating_point() == (kind is torch.float32)]
             for kind in (torch.float32, torch.int64)}  # split before either is read (reading replaces the tensors)
    for kind, these in parts.items():
        if these:
            read = torch.stack([values[i].detach().to(kind).reshape(()) for values, i in these]).tolist()
            for (values, i), value in zip(these, read):
                values[i] = value
