"""The reference policy of DPO and KTO: where its scores come from, chosen once when the Trainer is built.

- `adapters off`: a new LoRA adapter's reference is the base, the same model with its adapters disabled (peft's
  `disable_adapter`): no copy;
- `adapter ref`: a LoRA run dir given as `model.path` keeps training its adapter, and the reference is that adapter as
  loaded: a frozen copy named `ref` beside it, made active for the reference pass only;
- `copy`: full fine-tuning keeps a frozen copy of the model, loaded as the policy was, under the launch's sharding
  (DDP: on each device; FSDP2: sharded as TRL 1.16 shards its reference; ZeRO-3: its own inference engine).

With `train.precompute_ref_log_probs` the pass runs once before training and the rows carry its values
(reference_logps.py). The reference pass runs without gradients, through
the same scoring forward as the policy (train/scored.py).
"""

from __future__ import annotations

import contextlib
from copy import deepcopy

import torch

REF = "ref"  # the frozen adapter's name (`adapter ref`)


class Reference:
    def __init__(self, kind: str, model=None, precomputed: bool = False):
        self.kind = kind  # "adapters off", "adapter ref" or "copy": how the reference pass runs
        self.model = model  # `copy`: the frozen reference model, prepared for the launch (None: the policy before training)
        self.precomputed = precomputed  # the rows carry the reference's values: the pass runs once, before training

    def __call__(self, policy, accelerator, batch: dict, score):
        """`score(model, batch)` under the reference, without gradients; `policy` is the Trainer's (wrapped) model."""
        with torch.no_grad(), self._switched(policy, accelerator):
            return score(self.model if self.model is not None else policy, batch)

    def scoring_model(self, trainer):
        """The model a precompute runs on: the frozen copy, or the policy (in a DeepSpeed inference engine under
        ZeRO-3, built once)."""
        if self.model is None and trainer.is_deepspeed_enabled:
            self.model = deepspeed_engine(trainer.model, trainer.accelerator)
        return self.model if self.model is not None else trainer.model

    @contextlib.contextmanager
    def _switched(self, policy, accelerator):
        if self.kind == "adapters off":
            with accelerator.unwrap_model(policy).disable_adapter():
                yield
        elif self.kind == "adapter ref":
            peft_model = accelerator.unwrap_model(policy)
            active = peft_model.active_adapter
            peft_model.set_adapter(REF)
            try:
                yield
            finally:
                peft_model.set_adapter(active)  # peft makes the active adapter's weights the trained ones again
        else:
            yield


def choose(model, new_adapter: bool, precompute: bool, fsdp: bool, load_copy) -> Reference:
    """The reference for a policy `model` (before the Trainer wraps it); `new_adapter`: its LoRA adapter was made for
    this run; `load_copy()` loads the frozen copy. A precompute runs on the policy before training (it is the
    reference then), except under FSDP, where the copy is loaded for it (the policy is sharded only when training
    starts) and dropped after."""
    if hasattr(model, "peft_config"):
        if new_adapter:
            return Reference("adapters off", precomputed=precompute)
        add_frozen_copy(model)
        return Reference("adapter ref", precomputed=precompute)
    if precompute and not fsdp:
        return Reference("copy", precomputed=True)
    return Reference("copy", frozen(load_copy()), precomputed=precompute)


def trainer_with(model, args, plan, inputs: dict, make_loss, columns, per_row, settings: dict):
    """The project's Trainer for a method with a reference (DPO, KTO): the reference chosen for the model (`choose`),
    the loss `make_loss(aux, reference)`, the copy placed for the launch, and with `precompute_ref_log_probs` the rows
    given the reference's values as columns (`columns(loss, model, batch)`, `per_row` and `settings` as
    reference_logps.precompute takes them)."""
    from erniekit_lite.train import reference_logps
    from erniekit_lite.train.trainer import Trainer, ready

    reference = choose(model, plan.lora is not None, args.precompute_ref_log_probs, fsdp_launch(args), lambda: load_copy(plan))
    loss = make_loss(ready(model, args), reference)
    trainer = Trainer(model=model, args=args, loss=loss, **inputs)
    prepare(reference, trainer.accelerator)
    if reference.precomputed:
        reference_logps.precompute_datasets(trainer, reference, lambda model, batch: columns(loss, model, batch), per_row,
                                            settings, plan.data.cache)
    return trainer


def fsdp_launch(args) -> bool:
    """Whether this run is launched under FSDP (known before the Trainer, which reads the same settings)."""
    import os

    return bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")


def load_copy(plan):
    """The frozen reference of full fine-tuning: the model the plan names, loaded as the policy was, scoring in its
    forward (train/scored.py)."""
    from erniekit_lite.model.load import load_model
    from erniekit_lite.train import scored

    model = load_model(plan.source, plan.dtype, plan.attention, plan.trust_remote_code, load_in_4bit=plan.load_in_4bit)
    scored.take(model)
    return model


def add_frozen_copy(model) -> None:
    """The loaded adapter copied as the frozen `ref` adapter (what the reference pass activates)."""
    config = model.peft_config["default"]
    model.add_adapter(REF, deepcopy(config))
    for name, param in model.named_parameters():
        if ".default." in name:
            model.get_parameter(name.replace(".default.", f".{REF}.")).data.copy_(param.data)
    model.set_adapter("default")


def frozen(model):
    model.eval()
    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def prepare(reference: Reference, accelerator) -> Reference:
    """The frozen copy placed as the launch places models (the Trainer prepares only the policy)."""
    if reference.model is None:
        return reference
    state = accelerator.state
    if getattr(state, "deepspeed_plugin", None) is not None:
        reference.model = deepspeed_engine(reference.model, accelerator)
    elif getattr(state, "fsdp_plugin", None) is not None:
        reference.model = fsdp_sharded(reference.model, accelerator)
    else:
        reference.model = accelerator.prepare_model(reference.model, evaluation_mode=True)
    return reference


def deepspeed_engine(model, accelerator):
    """`model` in a DeepSpeed inference engine (after TRL 1.16's `prepare_deepspeed`): sharded under ZeRO-3,
    whole on each device otherwise; no optimizer or scheduler blocks."""
    import deepspeed

    config = deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    stage = config["zero_optimization"]["stage"]
    hidden = getattr(model.config.get_text_config(), "hidden_size", None)
    if hidden is not None and stage == 3:
        config.update({"zero_optimization.reduce_bucket_size": hidden * hidden,
                       "zero_optimization.stage3_param_persistence_threshold": 10 * hidden,
                       "zero_optimization.stage3_prefetch_bucket_size": 0.9 * hidden * hidden})
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    config["zero_optimization"].pop("offload_optimizer", None)
    if stage != 3:
        config["zero_optimization"]["stage"] = 0
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def fsdp_sharded(model, accelerator):
    """`model` under FSDP2's `fully_shard` with the plugin's settings (after TRL 1.16's `prepare_fsdp`)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    plugin = accelerator.state.fsdp_plugin
    if plugin.fsdp_version != 2:
        from erniekit_lite.errors import UserError

        raise UserError("a full fine-tuning reference under FSDP needs FSDP2 (recipes/accelerate/fsdp2.yaml)")
    if not isinstance(model, FSDPModule):
        fully_shard(model, reshard_after_forward=plugin.reshard_after_forward, offload_policy=plugin.cpu_offload,
                    mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy())
    model.eval()
    return model
