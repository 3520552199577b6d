"""Every pair (KTO: every example) weighs the same in an optimizer step, whatever the micro-batching, gradient
accumulation or process count.

TRL's preference losses are means over the pairs of one micro-batch and TRL marks them `loss_is_scaled_for_ga =
False`: the Trainer divides each micro-batch's loss by the accumulation steps G, and DDP (FSDP, ZeRO) averages the
W processes' gradients. A packed row holds a variable number of pairs, so a pair would weigh 1/(pairs in its
micro-batch): 2 rows per micro-batch and 1 row with accumulation 2 computed different things. The Trainer's own
remedy (`num_items_in_batch`) counts label tokens, and only for batches with `labels`.

Here the Trainer's per-step count is replaced: before each optimizer step the pairs N and the chosen response tokens
C of all its micro-batches are counted (summed over processes with `average_tokens_across_devices`, the Trainer's
switch for its token counts, on by default), and each micro-batch's loss (n pairs, c chosen tokens) becomes

    loss · (n/N) · G · W  +  coef · token_term · (c/C − n/N) · G · W

so that after the Trainer's 1/G and the processes' 1/W the step's gradient is that of (Σ per-pair terms)/N +
coef · (Σ chosen-token terms)/C: per-pair terms (DPO's losses, ORPO's odds ratio, SimPO, the reward model's loss and
its centring term, KTO's per-example losses) over the step's pairs, per-token terms (ORPO's NLL, CPO's `cpo_alpha`
NLL, DPO's `sft` loss type) over the step's chosen tokens. TRL's logged metrics are computed before this and keep
their meaning; the logged `loss` is the step's mean. What depends on the micro-batch by definition stays so, scaled
as a per-pair term: KTO's KL estimate (a clamped mean over the micro-batch's KL twins), DPO's `aot` /
`aot_unpaired` (sorted within the micro-batch) and the MoE router aux loss (a mean over the micro-batch's tokens).
"""

from __future__ import annotations

import torch

from erniekit_lite.train import ragged_gather
from erniekit_lite.train.step import ErnieTrainer, real_tokens


class PairTrainer(ErnieTrainer):
    """The base of the preference methods' Trainers (DPO, KTO, ORPO, SimPO, RM), before TRL's class: our pair rows
    (columns kept, real tokens counted) and every pair weighing the same in a step (the module doc).

    `units(batch)` counts a micro-batch's pairs (or examples); a loss with a per-token term stores it as
    `self._token_term = (coef, value)` during the forward that computed it."""

    _step_totals: tuple[float, float, int, int] | None = None
    _token_term: tuple[float, torch.Tensor] | None = None
    _last_batch: dict | None = None  # the step's last micro-batch when it is the training dataloader's last
    _last_rows: list[int] | None = None  # the pairs of each row of the micro-batch being scored, when it is the last

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # a packed micro-batch's pair count differs between processes, and accelerate evens out the last in rows
        ragged_gather.install(self.accelerator, lambda: self._last_rows, self)

    def _set_signature_columns_if_needed(self):
        self._signature_columns = ["input_ids", "labels", "seq_lengths"]

    def batch_real_tokens(self, inputs: dict) -> int:
        """The real tokens a micro-batch runs through the model (its keys popped)."""
        return real_tokens(inputs)

    def units(self, batch: dict) -> int:
        return batch["input_ids"].shape[0] // 2  # TRL's [2B, L] layout: chosen rows, then rejected

    def chosen_tokens(self, batch: dict) -> int:
        return batch["chosen_tokens"]  # counted by the pair collators on the CPU (data/pairs.py)

    def _get_num_items_in_batch(self, batch_samples: list, device) -> None:
        """The step's pairs and chosen tokens (the Trainer calls this once per optimizer step, on every process, with
        all the step's micro-batches). Returns None: TRL's losses take no `num_items_in_batch`. Counted on the host
        from the collators' numbers; across processes they are summed on the device and stay there (`weigh` scales
        with them as tensors), so no step waits to read them back."""
        pairs, tokens = sum(self.units(b) for b in batch_samples), sum(self.chosen_tokens(b) for b in batch_samples)
        processes = 1
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            counts = self.accelerator.gather(torch.tensor([[pairs, tokens]], dtype=torch.float64, device=device)).sum(0)
            pairs, tokens = counts[0], counts[1]
            processes = self.accelerator.num_processes
        # the Trainer fetches a step's micro-batches before running them: the dataloader's end is known now
        self._last_batch = batch_samples[-1] if self.accelerator.gradient_state.end_of_dataloader else None
        self._step_totals = (pairs, tokens, len(batch_samples), processes)
        return None

    def weigh(self, loss: torch.Tensor, batch: dict) -> torch.Tensor:
        """The micro-batch's loss weighted for its share of the step (training only; evaluation keeps TRL's mean)."""
        token_term, self._token_term = self._token_term, None
        if not self.model.training or self._step_totals is None:
            return loss
        pairs, tokens, accumulation, processes = self._step_totals
        scale = accumulation * processes
        share = self.units(batch) / pairs
        weighed = loss * (share * scale)
        if token_term is not None:  # C > 0: a pair is kept only if its prompt leaves room for a response (data/pairs.py)
            coef, value = token_term
            weighed = weighed + coef * value * ((self.chosen_tokens(batch) / tokens - share) * scale)
        return weighed

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        self.count_tokens(model, self.batch_real_tokens(inputs), inputs.pop("token_slots", 0))
        rows = inputs.pop("row_units", None)  # the collator's pairs (examples) per row, for `ragged_gather`
        last = (self._micro_batch is self._last_batch) if model.training else self.accelerator.gradient_state.end_of_dataloader
        self._last_rows = rows if last else None
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if return_outputs:
            return self.weigh(out[0], inputs), out[1]
        return self.weigh(out, inputs)
