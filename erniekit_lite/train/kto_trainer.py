"""TRL's KTOTrainer on padding-free packed rows of labelled completions and their KL twins.

TRL's: the whole loss, `KTOTrainer._compute_loss` (Eq. 7 of the KTO paper for `loss_type: kto`, APO-zero's unpaired
variant for `apo_zero_unpaired`; `desirable_weight` / `undesirable_weight`; the KL term as the clamped batch mean of
policy minus reference log-probs of the mismatched pairs, not back-propagated), its metrics (`kl`,
`rewards/chosen|rejected|margins`, `logps/*`, `logits/*`, `entropy`), the reference (the base with the adapter
disabled for a new LoRA adapter, TRL's `use_adapter`; a frozen copy, TRL's `ref_model`, for full fine-tuning; or
precomputed) and the router aux loss.

Ours: the data and the forward. TRL tokenizes prompt/completion text and builds each example's KL completion by
rotating completions by +1 within each block of `per_device_train_batch_size` examples in dataset order; our rows
come tokenized and packed with each example's KL twin fixed inside its row (data/unpaired.py: rotation within each
packed group). TRL then runs the model on padded [B, L] rows with full padding; ours runs it on one packed sequence
per side (per-sample attention, `use_cache=False`) and scores only trained positions (pair_scoring.py: the same
scoring path as DPO), returning TRL's padded [B, L-1] layout, so `_compute_loss` reads what it always reads. The
examples are scored with grad (TRL's own forward call), the KL twins without (`_compute_kl_logps`), both through
that path, and the reference passes too (`compute_ref_log_probs`, and TRL's own calls in `_compute_loss`).

Because the pairs live inside rows, any row order keeps them: TRL's two KL preconditions (sequential sampling, more
than one example per device batch) are about its in-batch pairing, so they are answered for it while TRL checks
them and the recipe's own values (default: random row order, any batch size) are put back after.
"""

from __future__ import annotations

import contextlib

import torch
from accelerate.utils import is_peft_model
from trl import KTOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from erniekit_lite.model.lora import unwrap
from erniekit_lite.train import scored
from erniekit_lite.train.step import real_tokens
from erniekit_lite.train.step_weights import PairTrainer

NOT_MODEL_INPUTS = ("completion_mask", "label", "ref_logps", "ref_KL_logps", "token_slots", "row_units")


def side(batch: dict, kl: bool) -> dict:
    """The model inputs of the examples (`kl` False) or of their KL twins (the `KL_` keys, without the prefix)."""
    if kl:
        return {k[3:]: v for k, v in batch.items() if k.startswith("KL_") and k != "KL_completion_mask"}
    return {k: v for k, v in batch.items() if not k.startswith("KL_") and k not in NOT_MODEL_INPUTS}


class ErnieKTOTrainer(PairTrainer, KTOTrainer):
    def __init__(self, *positional, args, reference_cache: bool = True, **kwargs):
        self.reference_cache = reference_cache  # read by the reference precompute, which runs inside TRL's __init__
        requested = args.per_device_train_batch_size, args.train_sampling_strategy
        args.per_device_train_batch_size, args.train_sampling_strategy = max(2, requested[0]), "sequential"
        try:
            super().__init__(*positional, args=args, **kwargs)
        finally:
            args.per_device_train_batch_size, args.train_sampling_strategy = requested
        self._train_batch_size = args.train_batch_size  # the Trainer read it while TRL's values were in place
        self._score_ourselves()

    def _score_ourselves(self) -> None:
        # Called again from `_precompute_ref_logps`, which TRL runs inside `__init__`, after its own fused head went on
        scored.instead_of_trl_head(unwrap(self.model), self.ref_model)  # a reference TRL built gets our class too

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset  # already tokenized, paired with KL twins and packed by erniekit_lite.data.unpaired

    def units(self, batch: dict) -> int:
        return len(batch["label"])  # KTO's loss is a mean over examples (step_weights.py)

    def chosen_tokens(self, batch: dict) -> int:
        return 0  # no per-token term

    def _set_signature_columns_if_needed(self):
        self._signature_columns = ["input_ids", "labels", "seq_lengths", "desirable", "ref_logps", "ref_KL_logps"]

    def batch_real_tokens(self, inputs: dict) -> int:
        real = real_tokens(inputs)
        if "KL_input_ids" in inputs:
            twins = real_tokens(inputs, "KL_")
            real += twins if self.calculate_KL else 0  # the twins run through the model too
        return real

    def _scores(self, model, batch: dict, kl: bool) -> torch.Tensor:
        """Summed completion log-probs per sequence of one side, through our packed forward (no grad here: TRL
        scores the examples with grad itself)."""
        out = model(**side(batch, kl), use_cache=False, fused_lm_head=True)
        return out.log_probs.sum(-1)

    def _compute_kl_logps(self, model, batch):
        """The KL twins' summed log-probs (policy, or reference under TRL's adapter switch), without grad as TRL's."""
        if not self.calculate_KL:
            return None
        if "KL_logp_index" not in batch:  # TRL's own padded batch
            return super()._compute_kl_logps(model, batch)
        with torch.no_grad():
            return self._scores(model, batch, kl=True)

    def compute_ref_log_probs(self, model, inputs):
        """TRL's reference pass (used to precompute), on our batch: (examples', twins') summed log-probs."""
        if "logp_index" not in inputs:
            return super().compute_ref_log_probs(model, inputs)
        adapter = contextlib.nullcontext()
        if self.ref_model is None and is_peft_model(self.model):
            unwrapped = self.accelerator.unwrap_model(self.model)
            adapter = use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
        with (torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs), adapter,
              self.accelerator.autocast()):
            examples = self._scores(model, inputs, kl=False)
            twins = self._scores(model, inputs, kl=True) if self.calculate_KL else None
        return examples, twins

    def _precompute_ref_logps(self, dataset, name, batch_size):
        """Reference log-probs per example and per twin, stored per row (a row holds whole examples, in collator
        order); sharded over the processes and cached (reference_logps.py)."""
        from erniekit_lite.train import reference_logps

        self._score_ourselves()

        def score(model, batch):
            examples, twins = self.compute_ref_log_probs(model, batch)
            return {"ref_logps": examples, "ref_KL_logps": twins}  # twins None without a KL term: no column

        return reference_logps.precompute(self, dataset, name, batch_size, score, per_row=lambda row: len(row["desirable"]),
                                          settings={"method": "kto", "kl": self.calculate_KL})
