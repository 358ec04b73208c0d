"""Every kernel compiles, without a GPU, to machine code for both of our targets: Hopper (sm_90,
where we measure) and CDNA3 (gfx942, MI300X, where we ship). One code path, checked on every CI run.
"""

import os

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tp_overlap_plugin.kernels.allreduce import one_shot_all_reduce_kernel
from tp_overlap_plugin.kernels.barrier import barrier_kernel

TARGETS = {"sm90": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64)}

KERNELS = {
    "barrier": (barrier_kernel,
                {"flags_ptr": "*i64", "epoch_ptr": "*i64", "rank": "i32", "world": "i32",
                 "heap_bases": "*i64", "error_ptr": "*i64", "max_spins": "i32"}, {}),
    "one_shot_all_reduce_bf16": (one_shot_all_reduce_kernel,
                                 {"x_ptr": "*bf16", "out_ptr": "*bf16", "stage_ptr": "*bf16",
                                  "ready_ptr": "*i64", "done_ptr": "*i64", "epoch_ptr": "*i64",
                                  "n": "i32", "rank": "i32", "world": "i32", "heap_bases": "*i64",
                                  "error_ptr": "*i64", "max_spins": "i32", "BLOCK": "constexpr"},
                                 {"BLOCK": 4096}),
}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_for_target(name, target):
    fn, signature, constexprs = KERNELS[name]
    compiled = triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs),
                              target=TARGETS[target])
    binary = "cubin" if target == "sm90" else "hsaco"
    assert compiled.asm.get(binary), f"{name}: no {binary} produced for {target}"
