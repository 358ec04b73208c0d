"""Tests that take a `device` argument run on the CPU (Triton interpreter) and, marked `gpu`, on
CUDA/ROCm GPUs; a GPU case with more ranks than GPUs present is skipped, unless
TP_OVERLAP_SHARE_GPUS=1 lets ranks share GPUs (tp_overlap_plugin/multirank.py)."""

import os
import tempfile

import pytest
import torch

from tp_overlap_plugin.multirank import gpu_ranks_fit

# The flag looks its tables up in the per-user cache before the shipped ones (tp_overlap_plugin/
# tables/): the tests, and the servers and ranks they start, get an empty cache of their own,
# whatever `tp-overlap tune` left in this user's.
os.environ["TP_OVERLAP_CACHE"] = tempfile.mkdtemp(prefix="tp_overlap_test_cache_")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The whole suite (plain `pytest`, as CI runs it) on two xdist workers, a test file per worker at a
    time, so that its module fixtures (servers) start once: most of the suite is one busy process
    (the interpreter, compiles, an engine), and CI has 2 cores. Not where a GPU is visible (GPU tests
    would share the GPUs with the other worker's), nor without pytest-xdist (the test extra), nor
    when a run names its tests or its own -n."""
    opt = config.option
    if (config.args_source == pytest.Config.ArgsSource.TESTPATHS and config.pluginmanager.hasplugin("xdist")
            and "PYTEST_XDIST_WORKER" not in os.environ   # a worker runs this hook too
            and getattr(opt, "numprocesses", None) is None and not opt.collectonly and not opt.usepdb
            and (os.cpu_count() or 1) > 1 and torch.cuda.device_count() == 0):
        opt.numprocesses, opt.dist = 2, "loadfile"


# The files that take longest on 2 cores (CI's "slowest" lists, bench/notes/ci.md), longest first. xdist's
# loadfile hands each idle worker the next file in collection order, so these go first: collected
# alphabetically, several of them came last, and one worker ran the tail alone while the other idled.
# By the per-file times of 2026-11-28 (bench/notes/ci.md); test_kernels_compile.py is cheap with a warm
# Triton cache but ~190 s with CI's cold one.
LONGEST_FIRST = ("test_bench_scripts.py", "test_tune.py", "test_dead_peer.py", "test_engine_api.py",
                 "test_tp_overlap_flag.py", "test_kernels_compile.py", "test_server_openai.py",
                 "test_server_tp_overlap.py", "test_engine_decode_profile.py", "test_gemv.py", "test_allreduce.py",
                 "test_server_processes.py", "test_server_responses.py", "test_server_errors.py", "test_overlap.py",
                 "test_tp_overlap_startup.py", "test_engine_async.py", "test_overlap_layers.py",
                 "test_engine_hf_parity.py", "test_gemm_core.py", "test_readme.py", "test_world8.py",
                 "test_engine_triton_attention.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: file order kept otherwise


def _printable(text):
    # undecodable bytes a server logged (surrogate escapes) would kill the xdist worker that sends
    # the report: its channel only takes valid UTF-8
    return text.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(text, str) else text


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.sections = [(title, _printable(body)) for title, body in report.sections]
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:   # a skip
        path, line, msg = report.longrepr
        report.longrepr = (path, line, _printable(msg))
    elif report.longrepr is not None:
        text = str(report.longrepr)
        if _printable(text) != text:   # a failure's text with such bytes: sent as plain text
            report.longrepr = _printable(text)


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
