"""The MoE router's z-loss and orthogonal loss beside the load-balancing aux loss (`train.router_z_loss_coef`,
`train.router_orthogonal_loss_coef`), as ERNIEKit computes them (paddleformers `nn/moe/topk_gate.py`, added per MoE
layer in `nn/moe/moe_alltoall_layer.py`; its `moe_z_loss_lambda`, `moe_orthogonal_loss_lambda`):

- z-loss of a layer: the mean over tokens of logsumexp(router logits)², the logits before the softmax; summed over
  the MoE layers. Here the mean is over the real tokens of the whole optimizer step (padding never counts; a packed
  row has none), so it weighs the same at any micro-batching and process count, as the token loss does.
- orthogonal loss of a layer: its router weight W [E, H] in fp32, each row divided by max(its L2 norm, 1e-12), then
  ||W·Wᵀ − I||² / E²; summed over the MoE layers. It depends on the router weight alone: once per optimizer step,
  whatever the micro-batching. ERNIEKit's grouped variant (`moe_group_orthogonal_loss`, experts in top-k groups) is
  not offered: ERNIE 4.5's released configs do not group their experts.
"""

from __future__ import annotations

import torch

EPS = 1e-12  # ERNIEKit's floor on a router row's norm


def z_loss_sum(router_logits, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Σ over MoE layers and real tokens of logsumexp(logits)²; `mask` [B, L] marks real tokens (None: all are)."""
    total = None
    for logits in router_logits:
        squares = torch.logsumexp(logits.float(), dim=-1).square()
        if mask is not None:
            squares = squares * mask.reshape(-1).to(squares.dtype)
        total = squares.sum() if total is None else total + squares.sum()
    return total


def orthogonal_loss(weights: list[torch.Tensor]) -> torch.Tensor:
    """Σ over the MoE routers' weights (`routers`) of ||Ŵ·Ŵᵀ − I||² / E², Ŵ a weight with its rows L2-normalised."""
    total = None
    for weight in weights:
        w = weight.float()
        w = w / w.norm(dim=1, keepdim=True).clamp_min(EPS)
        gram = w @ w.t() - torch.eye(w.shape[0], device=w.device, dtype=w.dtype)
        term = gram.square().sum() / gram.numel()
        total = term if total is None else total + term
    return total


def routers(model) -> list[torch.Tensor]:
    """The MoE routers' weights [E, H], in layer order (transformers' `mlp.gate.weight` of each MoE layer;
    ERNIE-4.5-VL's `mlp.text_moe.gate.weight` and `mlp.vision_moe.gate.weight`, two a layer)."""
    return [p for name, p in model.named_parameters() if name.endswith(("mlp.gate.weight", "_moe.gate.weight"))]


class RouterLosses:
    """What the SFT/PT trainer adds for the router (its `router`, made by `train/common.watch_moe`): the step's real
    tokens counted with its micro-batches (the z-loss's denominator) in `count_step`, both losses in `terms`."""

    def __init__(self, z_coef: float = 0.0, orthogonal_coef: float = 0.0):
        self.z_coef, self.orthogonal_coef = z_coef, orthogonal_coef
        self.step_real = None  # real tokens of the optimizer step, over all processes (a device tensor across processes)
        self._routers = None  # the routers' weights, found once (not by walking the model's parameters every micro-batch)

    def count_step(self, batch_samples: list, args, accelerator, device) -> None:
        """The collators count real tokens on the CPU (`collate.host_facts`): summed here, across processes on the
        device only for the z-loss that divides by them (with its coefficient 0 a multi-process step gathers nothing)."""
        real = sum(b["real_tokens"] for b in batch_samples) if all("real_tokens" in b for b in batch_samples) else None
        if real is not None and self.z_coef and args.average_tokens_across_devices and args.world_size > 1:
            real = accelerator.gather(torch.tensor([real], dtype=torch.float64, device=device)).sum()
        self.step_real = real

    def terms(self, model, scores, mask, real: int, steps: int | None, logged: dict, processes: int) -> torch.Tensor | int:
        """What the router losses add to a micro-batch's loss (0 when both are off); their values put in `logged`
        (metric name -> (sum, count), train/metrics.py). `steps`: the micro-batches of the optimizer step whose loss is not divided by them
        again (the token loss's `num_items_in_batch` case), None otherwise (evaluation). `processes`: what the
        Trainer's token loss is multiplied by (its `average_tokens_across_devices`)."""
        added = 0
        if self.z_coef and scores.router_logits is not None:
            z = z_loss_sum(scores.router_logits, mask)
            logged["z_loss"] = (z.detach() / max(1, real), 1)  # the micro-batch's mean, per layer summed
            if steps is not None and self.step_real is not None:
                added = added + self.z_coef * z * processes / self.step_real
            else:
                added = added + self.z_coef * z / max(1, real)
        if self.orthogonal_coef and model.training:
            self._routers = self._routers or routers(model)
            orthogonal = orthogonal_loss(self._routers)
            logged["orthogonal_loss"] = (orthogonal.detach(), 1)
            added = added + self.orthogonal_coef * orthogonal / (steps or 1)
        return added
