"""bench/decode_profile.py: runs end to end on the CPU with the demo model (sync and async scheduling,
the JSON it writes), and its kernel accounting (categories, GPU busy as a union of intervals) on a
made-up profiler trace."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "decode_profile.py"


def _module():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("decode_profile", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernel_accounting_on_a_synthetic_trace(tmp_path):
    dp = _module()
    names = {
        "_decode_kernel": "attention", "_decode_reduce_kernel": "attention",
        "nvjet_hsh_128x64_64x4_1x2_h_bz_coopA_NTN": "GEMM", "sm90_xmma_gemm_bf16bf16_bf16f32": "GEMM",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "all-reduce/comm",
        "rmsnorm_kernel": "norm/rope/act", "rope_cache_kernel": "norm/rope/act", "silu_mul_kernel": "norm/rope/act",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::ArgMaxOps<"
        "c10::BFloat16>, unsigned int, long, 4, 4> >": "sampling",
        "void at::native::index_elementwise_kernel<128, 4>": "other",
    }
    for n, c in names.items():
        assert dp.categorize(n, "kernel") == c, n
    assert dp.categorize("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy") == "memcpy/memset"
    # two steps: overlapping kernels count once in the busy time, a gap not at all
    ev = [dict(ph="X", cat="kernel", name="_decode_kernel", ts=0.0, dur=100.0),
          dict(ph="X", cat="kernel", name="nvjet_x", ts=50.0, dur=100.0),       # overlaps: busy 0..150
          dict(ph="X", cat="gpu_memcpy", name="Memcpy HtoD", ts=400.0, dur=50.0),
          dict(ph="X", cat="kernel", name="rmsnorm_kernel", ts=420.0, dur=10.0),  # inside the copy
          dict(ph="X", cat="cpu_op", name="aten::mm", ts=0.0, dur=1000.0),       # host side: ignored
          dict(ph="i", cat="kernel", name="marker", ts=0.0)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    got = dp.kernel_breakdown(dp.device_events(str(path)), steps=2)
    assert got["gpu_busy_ms_per_step"] == pytest.approx(0.1)      # (150 + 50) µs / 2
    assert got["ms_per_step"]["attention"] == pytest.approx(0.05)
    assert got["ms_per_step"]["GEMM"] == pytest.approx(0.05)
    assert got["ms_per_step"]["memcpy/memset"] == pytest.approx(0.025)
    assert got["kernels_per_step"] == 2
    assert got["top_kernels"][0]["name"] in ("_decode_kernel", "nvjet_x")


@pytest.mark.timeout(120)
def test_runs_on_the_cpu_and_writes_its_json(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", "demo", "--device", "cpu", "--batch", "1,3",
                        "--steps", "3", "--profile-steps", "2", "--warmup", "1", "--context", "20",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (js,) = tmp_path.glob("decode-profile-demo-tp1-cpu-*.json")
    res = json.loads(js.read_text())
    assert res["schema"] == "decode-profile/1"
    assert {"device", "torch", "triton", "date"} <= set(res["environment"])
    assert [(x["batch"], x["async_scheduling"]) for x in res["results"]] == [(1, False), (1, True), (3, False),
                                                                            (3, True)]
    for x in res["results"]:
        assert x["sequences_decoding"] == x["batch"]      # nobody finished or was preempted mid-measurement
        assert 20 <= x["mean_context"] <= 26
        assert x["step_ms_median"] > 0 and x["output_tokens_per_s"] > 0
        assert set(x["ms_per_step"]) == set(_module().CATEGORIES)
        for k in ("floor_ms", "gpu_busy_ms_per_step", "host_exposed_ms", "graph_replay_ms", "top_kernels"):
            assert k in x
    assert (tmp_path / js.name.replace(".json", ".md")).read_text().startswith("_cpu x0")



@pytest.mark.timeout(120)
def test_attention_table_runs_under_the_interpreter(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", "demo", "--device", "cpu", "--batch", "1,3",
                        "--context", "40", "--attention-only", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (js,) = tmp_path.glob("decode-profile-demo-tp1-cpu-*.json")
    rows = json.loads(js.read_text())["attention"]
    assert [(a["batch"], a["variant"][:2]) for a in rows] == [(1, "v1"), (1, "v2"), (3, "v1"), (3, "v2")]
    assert all(a["max_abs_err"] < 2e-2 and a["us"] > 0 for a in rows)


@pytest.mark.timeout(180)
def test_prefill_profile_runs_on_the_cpu_and_counts_the_rounds_work(tmp_path):
    """bench/prefill_profile.py with the flag at TP=2: a round of 2 prompts x 24 tokens in 16-token
    steps is 3 steps; the work it counts is the model's, and the layers' path is recorded."""
    script = ROOT / "bench" / "prefill_profile.py"
    r = subprocess.run([sys.executable, str(script), "--model", "demo", "--tp", "2", "--device", "cpu", "--prompts", "2",
                        "--prompt-len", "24", "--max-num-batched-tokens", "16", "--warmup", "1", "--rounds", "1",
                        "--tp-overlap", "--dispatch", "overlap", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (js,) = tmp_path.glob("prefill-profile-demo-tp2-cpu-*.json")
    res = json.loads(js.read_text())
    assert res["schema"] == "prefill-profile/1"
    x = res["result"]
    assert x["steps_per_round"] == 3 and len(x["step_ms"]) == 1 and len(x["step_ms"][0]) == 3
    from tp_overlap_plugin.serving import EngineConfig
    m = EngineConfig(model="demo").load_model_config()
    heads = m.num_heads // 2
    assert x["flops_per_round"]["attention"] == pytest.approx(2 * m.num_layers * 4 * heads * m.head_dim * 24 * 25 / 2)
    assert x["flops_per_round"]["linear"] > 0 and x["flops_per_round"]["linear"] % (2 * 48) == 0
    assert x["roofline"] is None and x["efficiency"] is None          # no GPU: no roofline
    assert sum(x["op_paths"].values()) > 0                            # the flag's layers ran and said how


def test_the_prefill_rounds_partition_adds_up_to_its_wall():
    """bench/prefill_profile.partition on made-up kernels (us): the step's own kernels, the time only the
    pulls or their waits run, the time nothing runs (its gaps by length) and the round's two ends are
    disjoint and add up to the wall. Told apart by kind, not stream: a graph replay scatters one stream's
    kernels over stream ids of its own (here the GEMMs come on 7 and 9)."""
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("prefill_profile", ROOT / "bench" / "prefill_profile.py")
    pp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pp)

    def k(ts, dur, stream, name="nvjet_gemm"):
        return {"name": name, "ts": 1000.0 + ts, "dur": dur, "args": {"stream": stream}}
    copy, wait = "Memcpy PtoP (Device -> Device)", "wait_ready_kernel"
    events = [k(0, 100, 7), k(100, 50, 9),                      # back to back
              k(153, 40, 7),                                     # a 3-us gap: nothing runs
              k(193, 45, 13, copy), k(238, 15, 13, wait),        # the step waits 70 us: 60 under a pull, 10 idle
              k(263, 30, 9),
              k(280, 40, 13, copy),                              # a pull beside a kernel, then alone for 27 us
              k(347, 100, 7), k(500, 10, 9, "signal_kernel")]    # 27 us of nothing before, 53 after
    part = pp.partition(events, wall_ms=0.600)
    assert part["streams"] == 3
    assert part["main_ms"] == pytest.approx((100 + 50 + 40 + 30 + 100 + 10) / 1e3)
    assert part["side_only_ms"] == pytest.approx((60 + 27) / 1e3)
    assert part["idle_gaps"] == {"<5us": [1, pytest.approx(0.003)], "5-20us": [1, pytest.approx(0.010)],
                                 ">=20us": [2, pytest.approx(0.080)]}
    assert part["idle_ms"] == pytest.approx(0.093)
    assert part["ends_ms"] == pytest.approx(0.600 - 0.510)
    assert part["ends_ms"] + part["main_ms"] + part["side_only_ms"] + part["idle_ms"] == pytest.approx(0.600)
