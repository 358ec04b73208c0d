"""Fuzz the server's OpenAPI schema with schemathesis: schema-valid and schema-violating requests to every
route, a bounded and reproducible number of them. No request may produce a 5xx, JSON answers must match
the documented response schemas, and the server must still be healthy afterwards."""

import httpx
import pytest

from tp_overlap_plugin.serving.testing import ServerProcess

pytestmark = pytest.mark.timeout(240)

MAX_EXAMPLES = 100   # per mode and route group; about 15 s in all on 2 CPU cores


@pytest.fixture(scope="module")
def server():
    # A short context keeps the generations that valid fuzz cases ask for short.
    with ServerProcess(["--max-model-len", "48", "--max-num-seqs", "64", "--no-access-log",
                        "--log-level", "error"]) as s:
        yield s


@pytest.fixture(scope="module")
def schema(server):
    schemathesis = pytest.importorskip("schemathesis")
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def _run(schema, server, mode, path_filter):
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import response_schema_conformance

    ops = schema.include(path_regex=path_filter)
    strategy = ops.as_strategy(generation_mode=mode)
    seen = {"calls": 0, "2xx": 0}

    @settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case):
        resp = case.call(base_url=server.url, timeout=60)
        seen["calls"] += 1
        seen["2xx"] += 200 <= resp.status_code < 300
        assert resp.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {resp.status_code} {resp.text}"
        ctype = resp.headers.get("content-type") or [""]   # schemathesis keeps every value of a header
        if (ctype if isinstance(ctype, str) else ctype[0]).startswith("application/json"):
            case.validate_response(resp, checks=[not_a_server_error, response_schema_conformance])

    check()
    print(f"fuzz {path_filter} {mode}: {seen}")
    return seen


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzz_generation_routes_no_5xx(schema, server, mode):
    from schemathesis import GenerationMode

    gm = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    seen = _run(schema, server, gm, r"^/v1/(chat/)?completions$")
    assert seen["calls"] >= MAX_EXAMPLES // 2
    if mode == "positive":
        # The schema is tight enough that schema-valid requests mostly succeed; a server that rejects
        # everything would pass the no-5xx check too, so that is checked separately.
        assert seen["2xx"] > 0, seen
    assert httpx.get(server.url + "/health").status_code == 200


def test_fuzz_other_routes_no_5xx(schema, server):
    from schemathesis import GenerationMode

    seen = _run(schema, server, GenerationMode.POSITIVE, r"^/(v1/models|health|metrics|version)$")
    assert seen["calls"] > 0
    m = httpx.get(server.url + "/metrics").text
    assert 'status="5' not in m, [l for l in m.splitlines() if 'status="5' in l]
    assert "tp_overlap_num_requests_running{model_name=\"demo\"} 0.0" in m
