"""TRL's GRPOTrainer with ERNIE rendering and packed completion scoring.

TRL's: generation (transformers' `generate`, or vLLM through `train.use_vllm` / `vllm_mode: server`), the reward
calls and their weighting, group advantages, the reference (the base with the adapter disabled for a new LoRA
adapter; a frozen copy for full fine-tuning; none at `beta: 0`), the whole loss (`_compute_loss`: grpo, dapo,
dr_grpo, bnpo, cispo, sapo, ...), its metrics and the training loop.

Ours, two narrow overrides:
- `_tokenize_prompts`: each prompt (chat messages) is rendered by erniekit-lite's template as training renders one
  (`data/prompts.prompt_ids`), not by the tokenizer's `apply_chat_template`: ERNIE's generation prompt ends in the
  token `▁` and user text never becomes a control token;
- `_get_per_token_logps_and_entropies`: every scoring pass (policy with grad, old policy, reference) runs the
  batch's sequences as one packed row with per-sample attention and the LM head only at completion positions
  (grpo_scoring.py), returning TRL's [B, C] layout, so `_compute_loss` reads what it always reads.
Generation itself is TRL's; a model loaded with a packed attention (`packed_sdpa` / `packed_varlen`, which ignore
padding) generates its left-padded batches under plain sdpa and switches back for scoring.
"""

from __future__ import annotations

import contextlib

import torch
from trl import GRPOTrainer

from erniekit_lite.data.prompts import prompt_ids
from erniekit_lite.data.template import template_for
from erniekit_lite.data.tokenize import Tokenizer
from erniekit_lite.model.attention import PACKED
from erniekit_lite.train.checkpoints import CheckpointMixin
from erniekit_lite.train.grpo_scoring import MARK, add_packed_scoring, packed_inputs, to_layout
from erniekit_lite.train.optimizer import LoraPlusMixin
from erniekit_lite.train.trainer import ThroughputMixin


def _inner(model):
    """The causal LM under PEFT and accelerate wrappers (its modules hold any adapters)."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class ErnieGRPOTrainer(CheckpointMixin, ThroughputMixin, LoraPlusMixin, GRPOTrainer):
    packed_scoring = True  # False (data.packing: false): TRL's own padded scoring (the parity tests compare the two)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._render = Tokenizer(self.processing_class, template_for(self.processing_class))
        for model in (_inner(self.model), self.ref_model):
            if model is not None:
                add_packed_scoring(model)  # after TRL's fused-LM-head patch, which stays for its own padded path

    def _tokenize_prompts(self, prompts: list):
        return [prompt_ids(self._render, messages) for messages in prompts], None, {}

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

    def count_tokens(self, model, real: int, slots: int) -> None:
        # TRL's `_generate` already adds prompt + completion tokens to num_input_tokens_seen: only the throughput
        # counters (tokens scored with grad, per second) are kept here
        if torch.is_grad_enabled():
            seen = self.state.num_input_tokens_seen
            super().count_tokens(model, real, slots)
            self.state.num_input_tokens_seen = seen


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
