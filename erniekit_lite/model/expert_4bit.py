"""The MoE's fused routed experts in 4-bit NF4 (`model.load_in_4bit`), dequantized one expert at a time as used.

bitsandbytes quantizes nn.Linear weights only; transformers keeps the routed experts as two 3-D parameters per MoE
layer (gate_up_proj [E, 2m, h], down_proj [E, h, m]), 20.38B of the 21B-A3B's 21.8B parameters, which so stayed
bf16. Here each is stored as bitsandbytes stores a Linear4bit weight (`quantize_4bit`: NF4, blocks of 64, the
absmax double-quantized in blocks of 256 around their mean), in one quantization state per parameter whose tensors
are sliced per expert: an expert's out·in elements are whole 64-blocks and, for ERNIE's widths, whole 256-blocks of
absmax too. Where they are not (tiny test models) each expert is quantized on its own, in the same layout.

The packed NF4 bytes replace the parameter itself ([E, out·in/2] uint8, frozen), so peft still finds and wraps it
(`ds_shape` gives it the logical [E, out, in] shape, as DeepSpeed's partitioned parameters do); the statistics are
non-persistent buffers of the experts module, so they move with it. `ExpertMatmul` dequantizes one expert's weight
in forward and again in backward (as bitsandbytes' MatMul4Bit does for a Linear4bit): no layer ever holds its
dequantized stack, and the frozen weight gets no gradient.
"""

from __future__ import annotations

import contextlib

import torch

BLOCK, NESTED = 64, 256  # bitsandbytes' 4-bit blocksize and its double quantization's
NAMES = ("gate_up_proj", "down_proj")
STATS = ("absmax", "absmax2", "offset", "code", "code2")


def is_4bit(experts) -> bool:
    return getattr(experts, "nf4_shapes", None) is not None


def quantize(experts, name: str, dtype: torch.dtype, weight: torch.Tensor | None = None, loading: bool = False) -> torch.nn.Parameter:
    """Replace `experts.<name>` ([E, out, in], any float dtype; or `weight`, its value being loaded) by its NF4
    bytes (returned) and statistics; `dtype` is what the dequantized weights compute in (the model's dtype)."""
    import bitsandbytes.functional as bnbf

    weight = (getattr(experts, name) if weight is None else weight).detach()
    count, numel = weight.shape[0], weight[0].numel()
    if numel % 2:
        raise ValueError(f"{name}: {numel} elements per expert cannot pack two 4-bit values a byte")
    if numel % (BLOCK * NESTED) == 0:  # one state for the stack, sliced per expert
        packed, state = bnbf.quantize_4bit(weight.reshape(-1), blocksize=BLOCK, compress_statistics=True, quant_type="nf4")
        parts = [(packed, state)]
    else:  # an expert's absmax would straddle a nested block: a state per expert
        parts = [bnbf.quantize_4bit(w.reshape(-1), blocksize=BLOCK, compress_statistics=True, quant_type="nf4") for w in weight]
    stats = {
        "absmax": torch.cat([s.absmax.reshape(-1) for _, s in parts]).view(count, -1),
        "absmax2": torch.cat([s.state2.absmax.reshape(-1) for _, s in parts]).view(count, -1),
        "offset": torch.cat([s.offset.reshape(1).expand(count // len(parts)) for _, s in parts]),
        "code": parts[0][1].code,
        "code2": parts[0][1].state2.code,
    }
    packed = torch.nn.Parameter(torch.cat([p.reshape(-1) for p, _ in parts]).view(count, -1), requires_grad=False)
    packed.ds_shape = weight.shape  # the shape peft's ParamWrapper reads (its DeepSpeed ZeRO-3 rule)
    # in place: the parameters keep their order, which decides how peft nests its wrappers (and so the saved names)
    experts._parameters[name] = packed
    for stat, value in stats.items():
        experts.register_buffer(f"{name}_{stat}", value.clone(), persistent=False)
    if loading:  # transformers refills every non-persistent buffer after loading: kept aside until `restore_stats`
        experts.nf4_loaded = {**getattr(experts, "nf4_loaded", {}), name: {s: getattr(experts, f"{name}_{s}") for s in STATS}}
    experts.nf4_shapes = {**(getattr(experts, "nf4_shapes", None) or {}), name: tuple(weight.shape[1:])}
    experts.nf4_dtype = dtype
    return packed


def restore_stats(experts) -> None:
    """After `from_pretrained`: the statistics quantized during loading back into their buffers."""
    for name, stats in getattr(experts, "nf4_loaded", {}).items():
        for stat, value in stats.items():
            setattr(experts, f"{name}_{stat}", value)
    experts.nf4_loaded = {}


@contextlib.contextmanager
def quantized_as_loaded(is_experts, dtype: torch.dtype):
    """Within: transformers' bitsandbytes 4-bit loading quantizes the fused expert weights too, each as soon as its
    layer's stack has been read and fused (transformers' weight conversions), so the model's bf16 experts are never
    all in memory at once. `is_experts(module)`: whether a module is a routed-experts module to quantize.

    transformers asks its quantizer, per checkpoint tensor, whether it `param_needs_quantization` and then runs
    `get_quantize_ops().convert` on the loaded (converted) value; both answer for the experts here and defer to
    bitsandbytes' own for the rest. A class-level patch, undone on exit. transformers then overwrites every
    non-persistent buffer (`_move_missing_keys_from_meta_to_device`): call `restore_stats` on each module after."""
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
    from transformers.quantizers.quantizers_utils import get_module_from_name

    needs, ops = Bnb4BitHfQuantizer.param_needs_quantization, Bnb4BitHfQuantizer.get_quantize_ops

    def ours(model, param_name: str) -> bool:
        module, name = get_module_from_name(model, param_name)
        return name in NAMES and is_experts(module)

    class Quantize:
        def __init__(self, theirs):
            self.theirs = theirs

        def convert(self, input_dict, model=None, **kwargs):
            result = {}
            for param_name, value in input_dict.items():
                if not ours(model, param_name):
                    result.update(self.theirs.convert({param_name: value}, model=model, **kwargs))
                    continue
                module, name = get_module_from_name(model, param_name)
                result[param_name] = quantize(module, name, dtype, value[0] if isinstance(value, list) else value, loading=True)
            return result

        def __getattr__(self, attr):  # anything else transformers asks of a conversion op: bitsandbytes' answer
            return getattr(self.theirs, attr)

    Bnb4BitHfQuantizer.param_needs_quantization = lambda self, model, name, **kw: ours(model, name) or needs(self, model, name, **kw)
    Bnb4BitHfQuantizer.get_quantize_ops = lambda self: Quantize(ops(self))
    try:
        yield
    finally:
        Bnb4BitHfQuantizer.param_needs_quantization, Bnb4BitHfQuantizer.get_quantize_ops = needs, ops


def dequantize_expert(experts, name: str, expert: int) -> torch.Tensor:
    """Expert `expert`'s weight of `experts.<name>` [out, in], in the experts' compute dtype."""
    import bitsandbytes.functional as bnbf
    from bitsandbytes.functional import QuantState

    stat = {s: getattr(experts, f"{name}_{s}") for s in STATS}
    shape = experts.nf4_shapes[name]
    nested = QuantState(absmax=stat["absmax2"][expert], code=stat["code2"], blocksize=NESTED, dtype=torch.float32)
    # dequantized flat, as quantized: bitsandbytes 0.50.2's CPU kernel, given [out, in] with `in` not a multiple of
    # the blocksize (tiny models), starts a new 64-block at every row and so scales later rows by the wrong absmax
    state = QuantState(absmax=stat["absmax"][expert], shape=torch.Size((shape[0] * shape[1],)), code=stat["code"],
                       blocksize=BLOCK, quant_type="nf4", dtype=experts.nf4_dtype, offset=stat["offset"][expert], state2=nested)
    return bnbf.dequantize_4bit(getattr(experts, name)[expert], state).view(shape)


def dequantize(experts, name: str) -> torch.Tensor:
    """The whole stack [E, out, in] (merge, reference tests): allocates it."""
    return torch.stack([dequantize_expert(experts, name, e) for e in range(getattr(experts, name).shape[0])])


def unquantize(experts) -> None:
    """Put the dequantized stacks back as ordinary frozen parameters (merge: peft adds adapters to those)."""
    for name in experts.nf4_shapes:
        weight = dequantize(experts, name)
        for stat in STATS:
            delattr(experts, f"{name}_{stat}")
        experts._parameters[name] = torch.nn.Parameter(weight, requires_grad=False)  # in place, as `quantize`
    experts.nf4_shapes = None


class ExpertMatmul(torch.autograd.Function):
    """rows [n, in] @ W_eᵀ with W_e dequantized in forward and again in backward; no gradient for W."""

    @staticmethod
    def forward(ctx, rows, experts, name, expert):
        ctx.args = experts, name, expert
        return rows @ dequantize_expert(experts, name, expert).t()

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return grad @ dequantize_expert(*ctx.args).to(grad.dtype), None, None, None


def grouped_4bit(x, experts, name: str, offsets) -> torch.Tensor:
    """x [S, in] (rows grouped by expert, group e ending at offsets[e]) @ W_eᵀ per group, W 4-bit: a loop over the
    experts hit, each dequantized only while its rows are multiplied."""
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
    parts = [ExpertMatmul.apply(rows, experts, name, e) for e, (rows, n) in enumerate(zip(x.split(counts), counts)) if n]
    return torch.cat(parts) if parts else x.new_zeros(0, experts.nf4_shapes[name][0])


def stack_bytes(experts) -> int:
    """Bytes the 4-bit stacks of one experts module hold (packed weights and statistics)."""
    total = 0
    for name in experts.nf4_shapes or {}:
        for t in [getattr(experts, name)] + [getattr(experts, f"{name}_{s}") for s in STATS]:
            total += t.numel() * t.element_size()
    return total
