"""TRL's SFTTrainer over rows we tokenized and packed ourselves (SFT and pt).

Two departures from `SFTTrainer.compute_loss`, both because ERNIE's 103k-entry LM head dominates small models:
- the LM head runs only at positions whose next token is trained, in memory-bounded chunks (`scoring.py`), so
  prompt tokens never pay for it; token accuracy comes from the same pass;
- the MoE router's z-loss and orthogonal loss beside the aux loss (`router_losses.RouterLosses`, on `self.router`).
The step itself (checkpoints, guard, optimizer, real-token accounting, the first-step retry) is `step.ErnieTrainer`;
everything else is TRL and transformers.
"""

from __future__ import annotations

import torch
from trl import SFTTrainer

from erniekit_lite.train.router_losses import RouterLosses
from erniekit_lite.train.step import ErnieTrainer, real_tokens


class ErnieSFTTrainer(ErnieTrainer, SFTTrainer):
    def __init__(self, *args, **kwargs):
        self.router = RouterLosses()  # its coefficients set by `common.watch_moe` for a MoE model
        super().__init__(*args, **kwargs)  # the model scores `score_labels=` in its forward (train/scored.py)

    def _get_num_items_in_batch(self, batch_samples: list, device):
        self.router.count_step(batch_samples, self.args, self.accelerator, device)
        return super()._get_num_items_in_batch(batch_samples, device)

    def evaluation_loop(self, *args, metric_key_prefix: str = "eval", **kwargs):
        """`eval_loss` as the token-weighted mean over the whole eval set, as training's loss is.

        The Trainer averages per-batch losses (weighted by rows), which over-weights tokens of short batches;
        `erniekit-lite eval` and this agree exactly.
        """
        self._eval_nll, self._eval_tokens = torch.zeros((), dtype=torch.float64, device=self.accelerator.device), 0
        output = super().evaluation_loop(*args, metric_key_prefix=metric_key_prefix, **kwargs)
        nll, tokens = self._eval_nll, torch.tensor(self._eval_tokens, device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            nll, tokens = self.accelerator.reduce(nll, "sum"), self.accelerator.reduce(tokens, "sum")
        if int(tokens) and f"{metric_key_prefix}_loss" in output.metrics:
            output.metrics[f"{metric_key_prefix}_loss"] = float(nll / tokens)
        return output

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        slots = inputs.pop("token_slots", labels.numel())
        real = real_tokens(inputs)
        scores = model(**inputs, score_labels=labels, output_router_logits=self.aux_loss_enabled,
                       score_router_logits=bool(self.router.z_coef))
        n = scores.log_probs.numel()
        loss = -scores.log_probs.sum() / (num_items_in_batch if num_items_in_batch is not None else max(1, n))
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes
        steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else None
        if scores.aux_loss is not None:
            loss = loss + self.router_aux_loss_coef * scores.aux_loss / (steps or 1)
            self._metrics[mode]["aux_loss"].append(scores.aux_loss.detach())  # read back when logged (`log`)
        processes = self.accelerator.num_processes if self.args.average_tokens_across_devices else 1
        loss = loss + self.router.terms(model, scores, inputs.get("attention_mask"), real, steps, self._metrics[mode], processes)
        if mode == "eval":
            self._eval_nll += -scores.log_probs.detach().double().sum()
            self._eval_tokens += n
        self._metrics[mode]["mean_token_accuracy"].append(scores.is_top1.sum() / max(1, n))
        self.count_tokens(model, real, slots)
        if mode == "train":
            self._metrics[mode]["num_tokens"] = [self.state.num_input_tokens_seen]
        return (loss, scores) if return_outputs else loss
