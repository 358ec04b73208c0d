"""The Triton internals we use, all behind kernels/triton_compat.py: each is present on this Triton
(CI runs 3.9, the GPU image 3.6: this file runs on both), and a missing one is a clear error that
names it, not an AttributeError deep inside a launch."""

import types

import pytest
import triton

from tp_overlap_plugin.kernels import triton_compat


def test_this_triton_is_one_we_checked():
    major_minor = ".".join(triton.__version__.split(".")[:2])
    assert major_minor in triton_compat.TESTED, (
        f"Triton {triton.__version__}: check every internal in kernels/triton_compat.py, then add it to TESTED")


def test_every_internal_is_there():
    assert callable(triton_compat.elementwise_max)
    assert triton_compat.interpreter_native() is not None
    marker = object()
    with triton_compat.allocator(marker):
        from triton.runtime import _allocation
        assert _allocation._allocator.get() is marker
    assert _allocation._allocator.get() is not marker
    assert triton_compat.is_interpreted(triton_compat.elementwise_max) in (True, False)


def test_the_host_clock_path_runs_forward():
    """The interpreter's clock (the compiled paths are checked in test_kernels_compile.py)."""
    t0 = int(triton_compat.clock_ns().handle.data[0])
    t1 = int(triton_compat.clock_ns().handle.data[0])
    assert 0 <= t1 - t0 < 10**9


def test_a_missing_internal_names_itself(monkeypatch):
    from triton.runtime import _allocation
    monkeypatch.delattr(_allocation, "_allocator")
    with pytest.raises(RuntimeError, match=r"lacks triton.runtime._allocation._allocator.*kernels/triton_compat.py"):
        with triton_compat.allocator(None):
            pass


def test_an_unknown_backend_has_no_clock():
    options = types.SimpleNamespace(backend_name="other")
    with pytest.raises(RuntimeError, match="a device clock for backend 'other'"):
        triton_compat.clock_ns(_semantic=types.SimpleNamespace(builder=types.SimpleNamespace(options=options)))
