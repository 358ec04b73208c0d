"""Every use of a Triton internal (a name with a leading underscore, or a module Triton does not
document) goes through this module, and each is checked against the Triton versions we run
(TESTED: 3.6 on the GPU image, 3.9 here). On another version a missing internal is a clear error at
first use naming the internal and the versions it was checked on, and
integration_tests/test_triton_compat.py fails on a Triton that lacks one.

What we take and why:
- `elementwise_max`: tl.standard._elementwise_max, the combine function of tl.max, as a core
  builtin. The all-reduces reduce their spin state with it once per poll; under the interpreter a
  call to a jit function (tl.max included) costs about a millisecond of patching per call.
- `allocator(fn)`: triton.runtime._allocation._allocator, the ContextVar behind
  triton.set_allocator, set only around our own launches so a caller's allocator stays theirs.
- `interpreter_native()` / `set_interpreter_native(x)`: triton.runtime.interpreter._interpreter, the
  interpreter's native memory operations, which the CPU heap wraps in a lock shared by the ranks
  (tp_overlap_plugin/heap.py: _InterpreterMemoryLock).
- `is_interpreted(fn)`: whether a jit function runs under the interpreter in this process.
- `wait_for_previous()` / `release_dependents()`: programmatic dependent launch (tl.extra.cuda's
  gdc_wait / gdc_launch_dependents, Hopper and later) where the target has it, nothing elsewhere (CDNA, the
  interpreter), so one kernel source serves both; `dependent_launch(device)` says whether a launch may
  ask for it.
- `clock_ns()`: a device clock in nanoseconds for the wall-clock bound of spin-waits (kernels/rma.py):
  %globaltimer on NVIDIA (tl.extra.cuda.globaltimer, ns), s_memrealtime on AMD
  (tl.extra.hip.memrealtime, a 100 MHz counter on CDNA), the host's monotonic clock under the
  interpreter. It picks the target from the compiler options it is called with.
"""

from __future__ import annotations

import contextlib
import functools
import time

import numpy as np
import triton
import triton.language as tl

TESTED = ("3.6", "3.9")
# s_memrealtime ticks at a constant 100 MHz on CDNA (MI200, MI300): 10 ns per tick
_AMD_REALTIME_NS_PER_TICK = 10


def _missing(what: str) -> RuntimeError:
    return RuntimeError(f"Triton {triton.__version__} lacks {what}, which tp-overlap uses (checked on Triton "
                        f"{', '.join(TESTED)}); kernels/triton_compat.py is the one place to adapt")


def _get(obj, name: str, what: str):
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _missing(what) from None


elementwise_max = getattr(tl.standard, "_elementwise_max", None)
if elementwise_max is None:  # pragma: no cover - a Triton we have not checked
    raise _missing("triton.language.standard._elementwise_max")


@contextlib.contextmanager
def allocator(fn):
    """Triton's device-scratch allocator (what triton.set_allocator sets) is `fn` inside the block."""
    from triton.runtime import _allocation
    var = _get(_allocation, "_allocator", "triton.runtime._allocation._allocator")
    token = var.set(fn)
    try:
        yield
    finally:
        var.reset(token)


def interpreter_native():
    from triton.runtime import interpreter
    return _get(interpreter, "_interpreter", "triton.runtime.interpreter._interpreter")


def set_interpreter_native(native) -> None:
    from triton.runtime import interpreter
    _get(interpreter, "_interpreter", "triton.runtime.interpreter._interpreter")
    interpreter._interpreter = native


def is_interpreted(fn) -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(fn, InterpretedFunction)


def clock_ns(_semantic=None):
    """Nanoseconds on a clock that runs alike for every program of the device (a builtin: call it
    from jit code as `triton_compat.clock_ns()`). Differences are meaningful, absolute values not."""
    if _semantic is None:  # the interpreter calls builtins it has not patched without a semantic
        from triton.runtime.interpreter import TensorHandle
        return tl.tensor(TensorHandle(np.array([time.monotonic_ns()], dtype=np.int64), tl.int64), tl.int64)
    backend = _backend(_semantic)
    if backend == "cuda":
        return tl.extra.cuda.globaltimer(_semantic=_semantic)
    if backend == "hip":
        ticks = tl.extra.hip.memrealtime(_semantic=_semantic)
        return ticks.__mul__(_AMD_REALTIME_NS_PER_TICK, _semantic=_semantic)
    raise _missing(f"a device clock for backend {backend!r}")


setattr(clock_ns, tl.core.TRITON_BUILTIN, True)  # what @tl.core.builtin marks, without its interpreter check


def _backend(_semantic) -> str | None:
    options = _get(_semantic.builder, "options", "the compiler options of a builtin's _semantic.builder")
    return getattr(options, "backend_name", None)


def _grid_dependency(name: str, _semantic) -> None:
    """tl.extra.cuda's grid dependency control op `name` on NVIDIA targets; nothing elsewhere."""
    if _semantic is not None and _backend(_semantic) == "cuda":
        from triton.language.extra import cuda
        _get(cuda, name, f"triton.language.extra.cuda.{name}")(_semantic=_semantic)


def wait_for_previous(_semantic=None):
    """In a kernel launched with programmatic dependent launch (`launch_pdl`), the point before which it
    may run while the kernel ahead of it in the stream still runs, and after which everything that kernel
    wrote is visible (griddepcontrol.wait; it returns at once in a kernel launched without it). Nothing
    on targets without it, and under the interpreter, where every kernel runs alone."""
    _grid_dependency("gdc_wait", _semantic)


def release_dependents(_semantic=None):
    """Let the kernel behind this one in the stream, if launched with programmatic dependent launch, start
    its own work up to its wait_for_previous() (griddepcontrol.launch_dependents); nothing elsewhere.
    Called only after this kernel's wait_for_previous(): a dependent that starts early then never runs
    beside a kernel two places ahead of it, so what it reads before its own wait is settled."""
    _grid_dependency("gdc_launch_dependents", _semantic)


for _builtin in (wait_for_previous, release_dependents):
    setattr(_builtin, tl.core.TRITON_BUILTIN, True)


@functools.lru_cache(maxsize=None)
def dependent_launch(device) -> bool:
    """Whether kernels on `device` may be launched with programmatic dependent launch: NVIDIA from Hopper
    (compute capability 9) on. Not on ROCm, nor the CPU. Kept per device: an op may ask at every launch."""
    import torch
    return (device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9)


def launch_hooks_active() -> bool:
    """Whether a launch hook is installed (a profiler such as proton): then launches take Triton's own
    path, which builds the metadata the hooks read (tp_overlap_plugin/launch.py). Asked per launch:
    Triton 3.9's hooks are chains (empty when unused), 3.6's None when unused."""
    runtime = triton.knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave))


def direct_launch(compiled):
    """A function (grid_x, stream, args) launching a compiled kernel (what `kernel[grid](...)` returns)
    without Triton's per-call binding: `args` are every parameter's value in signature order,
    constexprs included (the launcher skips them), as JITFunction.run passes them to
    CompiledKernel.run on Triton 3.6 and 3.9. No launch metadata, no hooks: callers check
    launch_hooks_active() first."""
    run, function, packed = _get(compiled, "run", "CompiledKernel.run"), compiled.function, compiled.packed_metadata

    def launch(grid_x, stream, args):
        run(grid_x, 1, 1, stream, function, packed, None, None, None, *args)
    return launch


def current_raw_stream():
    """The function Triton itself asks for the current stream's handle (torch's raw stream getter)."""
    from triton.runtime import driver
    return _get(driver.active, "get_current_stream", "triton.runtime.driver.active.get_current_stream")
