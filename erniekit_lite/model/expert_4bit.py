"""The MoE's fused routed experts in 4-bit NF4 (`model.load_in_4bit`): stored, computed, and put back.

bitsandbytes quantizes nn.Linear weights only; transformers keeps the routed experts as two 3-D parameters per MoE
layer (gate_up_proj [E, 2m, h], down_proj [E, h, m]), 20.38B of the 21B-A3B's 21.8B parameters, which so stayed
bf16. Here each is stored as bitsandbytes stores a Linear4bit weight (`quantize_4bit`: NF4, blocks of 64, the
absmax double-quantized in blocks of 256 around their mean), in one quantization state per parameter whose tensors
are sliced per expert: an expert's out·in elements are whole 64-blocks and, for ERNIE's widths, whole 256-blocks of
absmax too. Where they are not (tiny test models) each expert is quantized on its own, in the same layout.

The packed NF4 bytes replace the parameter itself ([E, out·in/2] uint8, frozen), so peft still finds and wraps it
(`ds_shape` gives it the logical [E, out, in] shape, as DeepSpeed's partitioned parameters do); the statistics are
non-persistent buffers of the experts module, so they move with it.

Computing (`matmul`): the stack is dequantized in runs of output rows, each run every expert's rows start:stop (one
bitsandbytes call), and multiplied by one grouped_mm over all the tokens; backward dequantizes the runs again (as
bitsandbytes' MatMul4Bit does for a Linear4bit). Runs of rows rather than of experts: which rows of the sorted tokens
belong to a run of experts is only known on the device, and slicing them would read it back (a GPU sync per run); a
row run needs no routing at all. Nothing reads the device on the host, and RUN_BYTES caps what is dequantized at once.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch

from erniekit_lite.model.grouped import experts_forward, grouped, splittable

BLOCK, NESTED = 64, 256  # bitsandbytes' 4-bit blocksize and its double quantization's
# The most bytes of dequantized weights alive at once (one run; the memory plan's transient): on the 21B-A3B a layer's
# gate_up stack [64, 3072, 2560] is 1.0 GB in bf16, and in runs of 384 rows 126 MB
RUN_BYTES = 128 * 2**20
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
    if numel % BLOCK:
        raise ValueError(f"{name}: {numel} elements per expert are not whole {BLOCK}-element 4-bit blocks")
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


def run_rows(shape: tuple[int, int, int], element_size: int) -> int:
    """Output rows of every expert dequantized at once: the largest equal split of `out` whose run ([E, rows, in] in
    the compute dtype) stays within RUN_BYTES, in whole 64-blocks and 16-byte rows (grouped_mm's alignment); the
    smallest such split when none stays within; all of `out` when there is none (shapes only: the same every call)."""
    return _run_rows(tuple(shape), element_size, RUN_BYTES)


@functools.cache  # asked in every forward and backward of every MoE layer: the search runs once per shape
def _run_rows(shape: tuple[int, int, int], element_size: int, cap: int) -> int:
    experts, out, inner = shape
    unit = math.lcm(BLOCK // math.gcd(inner, BLOCK), max(1, 16 // element_size))
    rows = out
    for parts in range(1, out // unit + 1):
        if out % parts == 0 and (out // parts) % unit == 0:
            rows = out // parts
            if experts * rows * inner * element_size <= cap:
                break
    return rows


def dequantize_rows(experts, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop of every expert's weight of `experts.<name>`, [E, stop - start, in] in the compute dtype: one
    bitsandbytes call over the run. The run's absmax is un-double-quantized here (bitsandbytes' own arithmetic:
    code2[q] · absmax2 of its 256-block + the expert's offset), so any run of whole 64-blocks dequantizes alone."""
    import bitsandbytes.functional as bnbf
    from bitsandbytes.functional import QuantState

    stat = {s: getattr(experts, f"{name}_{s}") for s in STATS}
    packed, inner = getattr(experts, name), experts.nf4_shapes[name][1]
    count, rows = packed.shape[0], stop - start
    first, last = start * inner // BLOCK, stop * inner // BLOCK
    low, high = first // NESTED, -(-last // NESTED)  # the run's absmax blocks lie in these nested blocks
    nested = stat["absmax2"][:, low:high].unsqueeze(-1).expand(-1, -1, NESTED).reshape(count, -1)
    nested = nested[:, first - low * NESTED:last - low * NESTED]
    scale = stat["code2"][stat["absmax"][:, first:last].int()] * nested + stat["offset"].unsqueeze(-1)
    if rows != experts.nf4_shapes[name][0]:  # a slice of each expert: its bytes gathered (E copies of a strided run)
        packed = packed[:, start * inner // 2:stop * inner // 2]
    state = QuantState(absmax=scale.reshape(-1), shape=torch.Size((count * rows * inner,)), code=stat["code"],
                       blocksize=BLOCK, quant_type="nf4", dtype=experts.nf4_dtype)
    return bnbf.dequantize_4bit(packed.reshape(-1), state).view(count, rows, inner)


def dequantize(experts, name: str) -> torch.Tensor:
    """The whole stack [E, out, in] (merge, reference tests): allocates it."""
    return dequantize_rows(experts, name, 0, experts.nf4_shapes[name][0])


class Matmul4bit(torch.autograd.Function):
    """x [S, in] sorted by expert -> x·W_eᵀ per group [S, out], W 4-bit: the stack dequantized a run of output rows at
    a time (every expert's rows start:stop) and multiplied by one grouped_mm per run; in backward the same runs are
    dequantized again for x's gradient. The frozen W gets none, and nothing dequantized outlives its run."""

    @staticmethod
    def forward(ctx, x, offsets, experts, name):
        ctx.save_for_backward(offsets)
        ctx.experts, ctx.name = experts, name
        runs = runs_of(experts, name, x.element_size())
        return torch.cat([grouped(x, dequantize_rows(experts, name, a, b).transpose(-2, -1), offsets) for a, b in runs], dim=1)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        (offsets,) = ctx.saved_tensors
        runs = runs_of(ctx.experts, ctx.name, grad.element_size())
        parts = (grouped(grad[:, a:b].contiguous(), dequantize_rows(ctx.experts, ctx.name, a, b), offsets) for a, b in runs)
        if len(runs) == 1:
            return next(parts), None, None, None
        total = torch.zeros(grad.shape[0], ctx.experts.nf4_shapes[ctx.name][1], dtype=torch.float32, device=grad.device)
        for part in parts:  # summed over the runs in fp32, as one matmul accumulates
            total += part
        return total.to(grad.dtype), None, None, None


def runs_of(experts, name: str, element_size: int) -> list[tuple[int, int]]:
    out, inner = experts.nf4_shapes[name]
    rows = run_rows((getattr(experts, name).shape[0], out, inner), element_size)
    return [(a, a + rows) for a in range(0, out, rows)]


def matmul(x, experts, name: str, offsets) -> torch.Tensor:
    """x [S, in] (rows grouped by expert, group e ending at offsets[e]) @ W_eᵀ per group, W = experts.<name> in 4-bit."""
    return Matmul4bit.apply(x, offsets, experts, name)


class FourBitExperts:
    """Mixed into a 4-bit experts module's class (`quantize_experts`, one subclass per base class): its own forward,
    taken when no expert adapter wraps it (routed experts not adapted, inference of the base, adapters disabled)."""

    base_class: type

    def forward(self, hidden_states, top_k_index, top_k_weights):
        project = lambda x, name, offsets: matmul(x, self, name, offsets)  # noqa: E731
        return experts_forward(self, hidden_states, top_k_index, top_k_weights, project, self.nf4_dtype)


_SUBCLASSES: dict[type, type] = {}


def four_bit_class(base: type) -> type:
    if base not in _SUBCLASSES:
        _SUBCLASSES[base] = type(f"FourBit{base.__name__}", (FourBitExperts, base), {"base_class": base})
    return _SUBCLASSES[base]


def quantize_experts(model, dtype: torch.dtype) -> int:
    """Store every routed-experts module of `model` in NF4 and give it the 4-bit forward; how many. One module at a
    time: only one layer's stack is ever quantized at once."""
    count = 0
    for module in list(model.modules()):
        if splittable(module) and not isinstance(module, FourBitExperts):
            restore_stats(module)
            for name in NAMES:
                if name not in (getattr(module, "nf4_shapes", None) or {}):  # not already quantized as loaded
                    quantize(module, name, dtype)
            module.__class__ = four_bit_class(type(module))
            count += 1
    return count


def unquantize_experts(model) -> None:
    """Put every 4-bit experts module's dequantized stacks back as ordinary frozen parameters, and its base class
    (merge: peft adds adapters to those)."""
    for module in list(model.modules()):
        if is_4bit(module):
            for name in module.nf4_shapes:
                weight = dequantize(module, name)
                for stat in STATS:
                    delattr(module, f"{name}_{stat}")
                module._parameters[name] = torch.nn.Parameter(weight, requires_grad=False)  # in place, as `quantize`
            module.nf4_shapes = None
            module.__class__ = type(module).base_class

def stack_bytes(experts) -> int:
    """Bytes the 4-bit stacks of one experts module hold (packed weights and statistics)."""
    total = 0
    for name in experts.nf4_shapes or {}:
        for t in [getattr(experts, name)] + [getattr(experts, f"{name}_{s}") for s in STATS]:
            total += t.numel() * t.element_size()
    return total
