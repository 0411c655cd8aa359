"""fp16 arithmetic on any device: real half tensors, or an emulation that rounds fp32 tensors to fp16.

An fp16 model can compute in two ways here (``train.fp16_impl``):

- ``half``: real half tensors (the model cast with ``.half()``, or torch autocast). What a CUDA GPU runs;
  on a CPU it works too, but slowly and with kernels that differ per instruction set.
- ``emulate``: the model keeps float32 tensors, and ``Fp16Emulation`` (a dispatch mode: it sees every
  aten operation, forward and backward) rounds them to fp16 at every point the fp16 model would hold a
  tensor. Rounding is ``x.to(float16).to(float32)``: fp16's range and precision exactly, so a value of
  65520 or more becomes inf (and a softmax of it NaN) where it would on a GPU, and values below 2^-24
  flush to zero. The same code path on every CPU; one operation computes in fp32 from fp16-valued inputs
  and rounds its output once, as a GPU kernel with fp32 accumulation does, except the half kernels that
  round inside (``HALF_KERNELS``: the MSE and its backward), whose operations it runs one by one.

Two policies, the two fp16 modes of ``train.fp16_mode``:

- ``fairseq`` (fairseq's ``--fp16``, what MERT trained with): weights, activations, the residual stream and
  gradients are all fp16. Emulated: the float32 outputs of every operation that reads a floating tensor
  are rounded (views and copies are not new values: every float32 tensor the model reads already holds
  fp16 values, its parameters rounded and its input cast; in-place results are rounded in place;
  factories such as ``torch.rand`` are exact draws). The model computes in fp32 on purpose in a few
  places ("fp32 islands": fairseq's fp32 GroupNorm, MERT's cosine logits and features penalty, the
  criterion, softmax of PB-relax): it writes them with ``fp32(x)``, which is ``x.float()`` on real half
  tensors and ``x.double()`` under emulation, where float32 stands for fp16; ``y.to(weight.dtype)`` brings
  an island's result back to the model's dtype (and the emulation rounds it). So islands and their
  gradients keep a wider type in both.
- ``amp`` (torch autocast): fp32 weights and residual stream; autocast's fp16 operations (matrix products,
  convolutions, SDPA) read and write fp16. Emulated: the float32 inputs and outputs of those operations are
  rounded, in forward and backward.

What the emulation does not reproduce: the accumulation order and internal precision inside a GPU kernel
(fp32 here, fp32 accumulators there; cuBLAS may split sums differently; tests/test_fp16_audit.py names
the operations where torch's CPU half kernels differ from it), and under ``amp`` the fp16 rounding of
elementwise operations between two autocast operations (computed in fp32 here from fp16-valued inputs,
rounded where the next autocast operation reads them: at most one rounding apart, the same range). fp32
islands compute in float64 under emulation (fp32 on a GPU). docs/FIDELITY.md lists what differs from
fairseq and torch 1.12 beyond that.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

FP16_POLICIES = ("fairseq", "amp")

# The aten operations torch autocast runs in fp16 (its CUDA "lower precision" list, as the operations reach
# a dispatch mode: linear, matmul and einsum arrive as these), with their backward operations.
AMP_FP16_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "addr", "convolution", "convolution_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
})
# Operations whose further outputs are statistics a GPU keeps in fp32 even for half inputs (mean, rstd,
# logsumexp, saved for backward): only their first output is an fp16 tensor.
FIRST_OUTPUT_ONLY = frozenset({
    "native_layer_norm", "native_group_norm", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
})

# Operations whose outputs hold their inputs' values (copies into new storage): under the fairseq policy
# every float32 tensor of the model holds fp16 values, so their outputs need no rounding (the same bits).
VALUE_COPIES = frozenset({"clone", "_unsafe_view", "slice_backward", "select_backward"})

_local = threading.local()  # per thread: the emulation policies entered, and how deeply rounding is paused


def round_fp16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to the nearest fp16 value (inf beyond fp16's range), in ``t``'s dtype."""
    return t.to(torch.float16).to(t.dtype)


def _stack() -> list[str]:
    if not hasattr(_local, "stack"):
        _local.stack, _local.paused = [], 0
    return _local.stack


def emulating() -> str | None:
    """The policy of the fp16 emulation active on this thread (``fairseq`` or ``amp``), or None."""
    stack = _stack()
    return stack[-1] if stack else None


def fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype of an fp32 island: float32, or float64 under the ``fairseq`` emulation, where
    float32 holds fp16 values (module docstring). Bool and integer tensors become that float type too."""
    return x.to(torch.float64 if emulating() == "fairseq" else torch.float32)


@contextlib.contextmanager
def no_rounding() -> Iterator[None]:
    """Pause the emulation's rounding on this thread: for values computed outside the fp16 model (targets
    such as the CQT, diagnostics) under ``torch.no_grad``. A no-op without emulation."""
    _stack()
    _local.paused += 1
    try:
        yield
    finally:
        _local.paused -= 1


def _round_float32(x):
    return round_fp16(x) if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x


def _round_float32_(x):
    """``_round_float32`` in place, for a fresh output (no other tensor sees its storage): one half-size
    temporary instead of two full ones; the same values."""
    if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
        x.copy_(x.to(torch.float16))
    return x


class _OpKind:
    """How the fairseq policy treats one aten operation (computed once per operation)."""

    def __init__(self, func):
        schema = func._schema
        self.name = func._overloadpacket.__name__
        # (position, name) of the arguments the operation writes into (in place, or out=)
        self.written = [(i, a.name) for i, a in enumerate(schema.arguments)
                        if a.alias_info is not None and a.alias_info.is_write]
        self.view = not self.written and any(r.alias_info is not None for r in schema.returns)
        self.first_only = self.name in FIRST_OUTPUT_ONLY
        self.amp = self.name in AMP_FP16_OPS
        self.kernel = None if self.written else HALF_KERNELS.get(self.name)
        self.copy = self.name in VALUE_COPIES


class Fp16Emulation(TorchDispatchMode):
    """Round to fp16 where an fp16 model would hold a tensor (module docstring), on this thread, for the
    operations run inside ``with Fp16Emulation(policy):`` (forward, and backward when it is called inside).

    The model's parameters must already hold fp16 values for the ``fairseq`` policy (``round_fp16`` them,
    as ``.half()`` would); the policy keeps them so, since their gradients and updates go through an fp32
    master copy (training/precision.py)."""

    _kinds: dict = {}

    def __init__(self, policy: str):
        if policy not in FP16_POLICIES:
            raise ValueError(f"fp16 emulation policy {policy!r}: choose one of {', '.join(FP16_POLICIES)}")
        super().__init__()
        self.policy = policy

    def __enter__(self):
        _stack().append(self.policy)
        return super().__enter__()

    def __exit__(self, *exc):
        _stack().pop()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "aten" or _local.paused:  # collectives (c10d) and paused regions: as they are
            return func(*args, **kwargs)
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _OpKind(func)
        if self.policy == "amp":
            if not kind.amp:
                return func(*args, **kwargs)
            args, kwargs = tree_map(_round_float32, (args, kwargs))  # autocast's casts of the inputs
            return _round_outputs(func(*args, **kwargs), kind)
        if kind.kernel is not None and _all_float32(args):  # a half kernel's own roundings, op by op
            return kind.kernel(*args, **kwargs)
        out = func(*args, **kwargs)
        if kind.written:  # in place (or out=): the written tensor holds fp16 values
            for i, name in kind.written:
                t = args[i] if i < len(args) else kwargs.get(name)
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    _round_float32_(t)
            return out
        if kind.view or kind.copy:  # no new values
            return out
        inputs = _tensors(args, kwargs)
        if not any(a.is_floating_point() for a in inputs):
            return out  # a factory or a cast from integers or booleans: exact draws and values
        # A functional operation's outputs are new tensors: rounded in place (cheaper), unless one shares
        # an input's storage (never expected of a non-view operation; checked all the same).
        shared = {a.untyped_storage().data_ptr() for a in inputs if a.device.type != "meta"}
        if isinstance(out, torch.Tensor):
            outputs = (out,)
        else:  # several outputs, or a Python number (item)
            outputs = _tensors(out, {}) if isinstance(out, (tuple, list)) else ()
        fresh = all(o.untyped_storage().data_ptr() not in shared for o in outputs if o.device.type != "meta")
        return _round_outputs(out, kind, in_place=fresh)


def _tensors(args, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an operation's arguments (or outputs): a loop over a flat argument list, as most
    operations have; the pytree only where one is a list or tuple (cat, index, several outputs)."""
    found = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple, dict)):
            return [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    return found


def _all_float32(args) -> bool:
    return all(a.dtype == torch.float32 for a in args if isinstance(a, torch.Tensor))


# Half kernels whose arithmetic the fairseq policy reproduces operation by operation, where rounding the
# fp32 result once would differ from what fp16 computes. torch's CPU and CUDA kernels for ``mse_loss`` and
# its backward do each step in fp16 (c10::Half arithmetic rounds every operation's result), in the same
# order on both (docs/FIDELITY.md, "musical loss").
REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2


def mse_loss_half(a: torch.Tensor, b: torch.Tensor, reduction: int = REDUCTION_MEAN) -> torch.Tensor:
    """``mse_loss`` of fp16 values held in float32, as torch's half kernel computes it: ``diff = a - b`` and
    ``diff * diff`` each rounded to fp16; the mean a float32 sum divided by the element count in float32 and
    rounded once (CPU; CUDA sums in another order and multiplies by the float32 reciprocal: the same single
    rounding); the sum a float32 sum rounded once (CUDA's; CPU's half sum kernel adds in another order)."""
    sq = _round_float32_(a - b)
    sq = _round_float32_(sq.mul_(sq))
    if reduction == REDUCTION_NONE:
        return sq
    total = sq.sum()
    return _round_float32_(total.div_(sq.numel()) if reduction == REDUCTION_MEAN else total)


def mse_loss_backward_half(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           reduction: int) -> torch.Tensor:
    """``mse_loss_backward`` of fp16 values held in float32, as torch's half kernel computes it (CPU and CUDA
    alike): ``alpha * (a - b) * grad`` with ``alpha = 2 / numel`` (2 without a mean) converted to fp16 through
    float32 (``Scalar::to<Half>``), and every product and difference rounded to fp16. At MERT-330M's size
    alpha is a subnormal (68 x 2^-24), so ``alpha * (a - b)`` is quantized to multiples of 2^-24 before the
    large upstream gradient (loss scale x masked frames) multiplies it."""
    alpha = 2.0 / a.numel() if reduction == REDUCTION_MEAN else 2.0
    alpha = torch.tensor(alpha, dtype=torch.float32).to(torch.float16).item()
    scaled = _round_float32_(_round_float32_(a - b).mul_(alpha))
    return _round_float32_(scaled.mul_(grad))


HALF_KERNELS = {"mse_loss": mse_loss_half, "mse_loss_backward": mse_loss_backward_half}


def _round_outputs(out, kind: _OpKind, in_place: bool = False):
    rounded = _round_float32_ if in_place else _round_float32
    if isinstance(out, torch.Tensor):
        return rounded(out)
    if kind.first_only and isinstance(out, tuple):
        return (rounded(out[0]), *out[1:])
    return tree_map(rounded, out)


def emulation(policy: str | None) -> contextlib.AbstractContextManager:
    """``Fp16Emulation(policy)``, or a no-op context for None."""
    return Fp16Emulation(policy) if policy else contextlib.nullcontext()


@torch.no_grad()
def round_parameters_(module: torch.nn.Module) -> None:
    """Round every floating parameter of ``module`` to fp16 values in place (the emulated ``.half()``)."""
    for p in module.parameters():
        if p.is_floating_point():
            p.copy_(round_fp16(p))
