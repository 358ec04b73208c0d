"""Launching one op's Triton kernel with Triton's per-call host work done once per specialization.

Why: `kernel[grid](**kwargs)` binds every argument, computes the specialization key and looks the
compiled kernel up on every call: 18 us of host time per launch of the one-shot all-reduce on an
H200 host (Triton 3.6), against 7.5 us for the whole of torch's C++ symmetric-memory all-reduce
(bench/notes/allreduce.md). Our ops launch one kernel per call, so eager callers (vLLM's eager
mode, prefill steps above the graph buckets, tune's eager rows) were host-bound.

A `Launcher` belongs to one op instance. The op names at construction the arguments that stay fixed
(heap buffers, strides of its own slots, constexprs, num_warps) and the ones that vary per call.
Per call it computes what of the varying ones can change the compiled kernel (Triton specialises a
pointer on 16-byte alignment, an integer on being 1 or a multiple of 16, and compiles one kernel
per constexpr value and dtype, and types an integer i32, i64 or u64 by its value); the first call with a new such key goes through Triton
(compiling if needed) and keeps the compiled kernel, later ones launch it directly
(kernels/triton_compat.direct_launch). The key is conservative: it also splits on integers that
the kernel does not specialise (do_not_specialize), which costs at most an extra lookup.

The interpreter (CPU) and an installed launch hook (a profiler) take Triton's path on every call.
"""

from __future__ import annotations

import inspect

import torch

from tp_overlap_plugin.kernels import triton_compat


def _spec_source(name: str, value, constexpr: bool) -> str:
    """Python source of what of a varying argument the compiled kernel depends on, for the kind of
    `value` (the argument's first value): a constexpr's value (one kernel per value: BLOCK_M 16 and
    32 are two kernels, though both are multiples of 16); a tensor's dtype and 16-byte alignment; an
    integer's being 1 or a multiple of 16, the width Triton gives it (i32 within [-2**31, 2**31),
    else i64, u64 from 2**63: a kernel compiled for an i32 truncates a larger value) and its type (a
    later float or bool there is another kernel); a float's type; anything else (a bool, None) by
    value."""
    if constexpr:
        return name
    if isinstance(value, torch.Tensor):
        return f"{name}.dtype, {name}.data_ptr() & 15 == 0"
    if isinstance(value, int) and not isinstance(value, bool):
        return (f"type({name}), {name} == 1, {name} & 15 == 0, -0x80000000 <= {name} <= 0x7fffffff, "
                f"{name} >= 0x8000000000000000")
    if isinstance(value, float):
        return f"type({name})"
    return name


def _generated(values: tuple, slots: list[int], constexprs: list[bool]):
    """(key, fill): the key of a call's varying arguments, and the argument list with them put into
    their slots of a template, as generated functions (Triton generates its binder the same way): a
    generic per-argument loop cost as much host time as the launch it saves. Built from the first
    call's values; a later value of another kind fails in `key` (AttributeError, TypeError) or gives
    another key, never the wrong kernel."""
    names = [f"a{i}" for i in range(len(values))]
    params = ", ".join(names)
    body = ", ".join(_spec_source(n, v, c) for n, v, c in zip(names, values, constexprs))
    puts = "".join(f"    t[{slot}] = {n}\n" for slot, n in zip(slots, names))
    scope: dict = {}
    exec(f"def key({params}):\n    return ({body + ',' if body else ''})\n"  # noqa: S102 - our own source
         f"def fill(template, {params}):\n    t = template.copy()\n{puts}    return t\n", scope)
    return scope["key"], scope["fill"]


class Launcher:
    """`launcher(grid_x, *varying)`: the kernel on a 1-D grid, with `varying` (in the order given at
    construction) and the fixed arguments."""

    def __init__(self, kernel, device: torch.device, varying: tuple[str, ...], **fixed):
        self.kernel, self.varying = kernel, tuple(varying)
        names = list(kernel.arg_names)
        missing = [n for n in self.varying if n not in names]
        unknown = [n for n in fixed if n not in names and n not in _OPTIONS]
        if missing or unknown:
            raise ValueError(f"Launcher for {kernel.__name__}: not parameters of the kernel: {missing + unknown}")
        defaults = {n: p.default for n, p in inspect.signature(kernel.fn).parameters.items() if p.default is not _EMPTY}
        absent = [n for n in names if n not in fixed and n not in self.varying and n not in defaults]
        if absent:
            raise ValueError(f"Launcher for {kernel.__name__}: no value for {absent}")
        self.fixed = fixed
        self.direct = device.type == "cuda"
        # the argument tuple in signature order, with the varying slots to fill per call
        self.template = [fixed[n] if n in fixed else defaults.get(n) for n in names]
        self.slots = [names.index(n) for n in self.varying]
        # the parameters annotated tl.constexpr (an object, or its source text under postponed annotations)
        constexprs = {n for n, p in inspect.signature(kernel.fn).parameters.items() if "constexpr" in str(p.annotation)}
        self.constexprs = [n in constexprs for n in self.varying]
        self.compiled: dict = {}
        self.key = self.fill = None  # generated from the first call (_generated)
        if self.direct:
            self.raw_stream = triton_compat.current_raw_stream()
            self.device_index = device.index if device.index is not None else torch.cuda.current_device()

    def __call__(self, grid_x: int, *values) -> None:
        if self.direct and not triton_compat.launch_hooks_active():
            if self.key is None:
                self.key, self.fill = _generated(values, self.slots, self.constexprs)
            key = self.key(*values)
            launch = self.compiled.get(key)
            if launch is not None:
                launch(grid_x, self.raw_stream(self.device_index), self.fill(self.template, *values))
                return
            compiled = self.kernel[(grid_x,)](**self.fixed, **dict(zip(self.varying, values)))
            self.compiled[key] = triton_compat.direct_launch(compiled)
            return
        self.kernel[(grid_x,)](**self.fixed, **dict(zip(self.varying, values)))


_EMPTY = inspect.Parameter.empty
# launch options a kernel call takes besides its parameters
_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_pdl"})
