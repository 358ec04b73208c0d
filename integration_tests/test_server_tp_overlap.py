"""The served path with the flag: `tp-overlap serve --tp 2 --tp-overlap` answers the openai client
with the same greedy text as the stock server, and its /metrics show the overlapped kernels ran."""

import json
import os

import httpx
import openai
import pytest

from serving_helpers import ServerProcess

pytestmark = pytest.mark.timeout(400)

# fp16: the fused GEMM kernels take bf16/fp16 (the demo model defaults to fp32 on the CPU)
ARGS = ["--tp", "2", "--dtype", "float16", "--max-model-len", "128", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "32", "--no-access-log", "--log-level", "warning"]
PROMPTS = ["The tensor-parallel engine says:", "Hi"]


def _texts(url):
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
        done = [c.completions.create(model="demo", prompt=p, max_tokens=2, temperature=0,
                                     extra_body={"ignore_eos": True}) for p in PROMPTS]
        chat = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "tensors?"}],
                                         max_tokens=2, temperature=0)
    return [d.choices[0].text for d in done] + [chat.choices[0].message.content]


def test_served_with_flag_equals_stock():
    with ServerProcess(ARGS) as stock:
        ref = _texts(stock.url)
    overlap_args = ARGS + ["--tp-overlap-config", json.dumps({"dispatch": "overlap"})]
    with ServerProcess(overlap_args, env={**os.environ, "TRITON_INTERPRET": "1"}, start_timeout=300) as srv:
        got = _texts(srv.url)
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    assert got == ref
    calls = {line.split('path="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
             for line in metrics.splitlines() if line.startswith("tp_overlap_tp_op_calls_total{")}
    assert calls.get("ag_gemm.kernel", 0) > 0 and calls.get("gemm_rs.kernel", 0) > 0, calls
