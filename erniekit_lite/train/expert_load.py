"""Per-layer expert load of an MoE during training: the share of routed tokens each expert received.

Counts come from the router logits the scoring forward already returns, with the router's own selection rule
(top-k of softmax probabilities plus `e_score_correction_bias`), over real tokens only. They accumulate on the
device (no per-step host sync) and are written as `expert_load.json` and a layers x experts heatmap
`expert_load.png`, where a collapsed expert (a bright cell) or a dead one (a dark column) shows at a glance.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from erniekit_lite.model.lora import unwrap


class ExpertLoad:
    def __init__(self, model):
        # Routers in forward order; `router_logits` has one entry per MoE layer in the same order. ERNIE-4.5-VL has
        # two a layer (`mlp.text_moe.gate`, `mlp.vision_moe.gate`) and one entry of logits, each token's row from
        # the router of its modality (`moe_mm_token_type_ids`): each router counts its own tokens
        self.routers = [(name, m) for name, m in model.named_modules()
                        if name.endswith(("mlp.gate", "mlp.text_moe.gate", "mlp.vision_moe.gate")) and hasattr(m, "top_k")]
        self.layers = [int(name.split("layers.")[1].split(".")[0]) for name, _ in self.routers]
        self.kinds = [1 if name.endswith("vision_moe.gate") else 0 if name.endswith("text_moe.gate") else None
                      for name, _ in self.routers]  # the modality a router takes (None: every token)
        self.counts: torch.Tensor | None = None
        self._biases: list[torch.Tensor | None] | None = None  # the frozen correction biases, whole (`_whole_biases`)

    def add(self, router_logits, attention_mask: torch.Tensor | None = None, modality: torch.Tensor | None = None) -> None:
        """Count one forward's routing; `modality`: ERNIE-4.5-VL's `moe_mm_token_type_ids` (0 text, else vision)."""
        keep = attention_mask.reshape(-1).bool() if attention_mask is not None else None
        vision = modality.reshape(-1).bool() if modality is not None else None
        per_layer = iter(router_logits)
        rows, logits = [], None
        with torch.no_grad():
            for (_, router), kind, bias in zip(self.routers, self.kinds, self._whole_biases()):
                if kind != 1:  # a text router (or the only one) starts its layer's entry; the vision one shares it
                    logits = next(per_layer)
                probs = torch.softmax(logits.detach().float(), dim=-1)
                chosen = torch.topk(probs + (bias if bias is not None else _bias(router)), router.top_k, dim=-1).indices
                real = torch.ones_like(chosen)
                if keep is not None:
                    if keep.numel() != chosen.shape[0]:
                        raise ValueError(f"expert load: the attention mask covers {keep.numel()} tokens, the router "
                                         f"logits {chosen.shape[0]}; cannot tell real tokens from padding")
                    real = real * keep[:, None]
                if kind is not None:  # weights, not a boolean index (its size is a host read)
                    mine = (vision if kind == 1 else ~vision) if vision is not None else torch.full_like(chosen[:, 0], kind == 0, dtype=torch.bool)
                    real = real * mine[:, None]
                # a scatter, not `bincount` or a boolean mask: their output sizes are host reads, a GPU sync each
                rows.append(chosen.new_zeros(router.num_experts).scatter_add_(0, chosen.reshape(-1), real.reshape(-1)))
            counts = torch.stack(rows)
        self.counts = counts if self.counts is None else self.counts + counts

    def _whole_biases(self) -> list[torch.Tensor | None]:
        """Each router's correction bias, whole, taken once at the first count: it is frozen
        (`model.load.freeze_router_statistics`), and under FSDP2 taking it is a collective per layer (27 on the
        21B-A3B), which on every forward cost one all-gather per layer and micro-step. A bias that trains (None here)
        is read at each count."""
        if self._biases is None:
            self._biases = [None if _parameter(router).requires_grad else _bias(router) for _, router in self.routers]
        return self._biases

    def save(self, out: Path, main_process: bool = True) -> None:
        """Write the files (main process only); in a launched run every process must call it (counts are summed)."""
        if self.counts is None:
            return
        counts = self.counts.clone()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts)
        if not main_process:
            return
        out = Path(out)
        counts = counts.cpu()
        routed = int(counts[: 2 if self.kinds[0] is not None else 1].sum()) if len(counts) else 0  # the first layer's routers
        data = {
            "layers": self.layers,
            **({"routers": ["vision" if k == 1 else "text" for k in self.kinds]} if any(k is not None for k in self.kinds) else {}),
            "experts": counts.shape[1],
            "top_k": self.routers[0][1].top_k,
            "routed_tokens": routed // max(1, self.routers[0][1].top_k),
            "counts": counts.tolist(),
            "share": (counts.double() / counts.sum(-1, keepdim=True).clamp(min=1)).tolist(),
        }
        (out / "expert_load.json").write_text(json.dumps(data) + "\n")
        _heatmap(data, out / "expert_load.png")


def _parameter(router):
    return router.moe_statics.e_score_correction_bias


def _bias(router) -> torch.Tensor:
    """The router's `e_score_correction_bias`, whole: what `moe_statics` adds to the probabilities before top-k. Under
    FSDP2 it is a shard outside the layer's forward, gathered here (every rank counts at the same step)."""
    bias = _parameter(router)
    if hasattr(bias, "full_tensor"):  # a DTensor
        bias = bias.full_tensor()
    return bias.detach().float().squeeze()


def _heatmap(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    share = torch.tensor(data["share"]).numpy()
    uniform = 1.0 / data["experts"]
    fig, ax = plt.subplots(figsize=(min(16, max(6, 3 + 0.2 * data["experts"])), min(12, 2 + 0.35 * len(data["layers"]))))
    # Colour is load relative to a uniform router (1.0): collapsed experts glow, dead ones are black
    image = ax.imshow(share / uniform, aspect="auto", cmap="magma", vmin=0)
    ax.set_xlabel(f"expert ({data['routed_tokens']:,} tokens routed, top-{data['top_k']})")
    ax.set_ylabel("layer")
    kinds = data.get("routers") or [""] * len(data["layers"])
    ax.set_yticks(range(len(data["layers"])), [f"{i} {k}".strip() for i, k in zip(data["layers"], kinds)])
    ax.set_title("expert load: share of tokens relative to uniform")
    fig.colorbar(image, ax=ax, label="x uniform share")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def track(model) -> ExpertLoad | None:
    """Start recording expert load on an MoE model (or its peft wrapper); None for dense models."""
    base = unwrap(model)
    load = ExpertLoad(base)
    if not load.routers:
        return None
    base.expert_load = load  # read by the scoring forward (train/scored.py, model/reward.py)
    return load


def save_callback(load: ExpertLoad):
    """A Trainer callback that refreshes expert_load.{json,png} in the output dir at each checkpoint."""
    from transformers import TrainerCallback

    class SaveExpertLoad(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            load.save(Path(args.output_dir), state.is_world_process_zero)

    return SaveExpertLoad()
