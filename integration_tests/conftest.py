"""Tests that take a `device` argument run on the CPU (Triton interpreter) and, marked `gpu`, on
CUDA/ROCm GPUs; a GPU case with more ranks than GPUs present is skipped, unless
TP_OVERLAP_SHARE_GPUS=1 lets ranks share GPUs (tp_overlap_plugin/multirank.py)."""

import os
import tempfile

import pytest
import torch

from tp_overlap_plugin.multirank import gpu_ranks_fit

# The flag looks its tables up in the per-user cache before the shipped ones (tp_overlap_plugin/
# tables.py): the tests, and the servers and ranks they start, get an empty cache of their own,
# whatever `tp-overlap tune` left in this user's.
os.environ["TP_OVERLAP_CACHE"] = tempfile.mkdtemp(prefix="tp_overlap_test_cache_")


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])


@pytest.fixture(autouse=True)
def _skip_without_gpus(request):
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    if params.get("device") == "cuda":
        need = params.get("world", 1)
        if not gpu_ranks_fit(need):
            pytest.skip(f"needs {need} GPUs, found {torch.cuda.device_count()}")
