"""`tp-overlap bench serve` with `vllm bench serve`'s command line (issue 54, item 7): its flags, its
result keys, its datasets (random with a shared prefix, ShareGPT from a local file, Hugging Face), and the
one-line errors of flags that do not fit. One small demo server for the module."""

import json
import re
import sys
import time
import types

import pytest

from tp_overlap_plugin.cli.bench import bench_serve_config_from_args
from tp_overlap_plugin.cli.main import build_parser, main
from tp_overlap_plugin.serving.benchmarks import serve_datasets
from tp_overlap_plugin.serving.benchmarks.serve import request_body
from tp_overlap_plugin.serving.benchmarks.serve_config import BenchServeConfig
from tp_overlap_plugin.serving.user_errors import CliError
from serving_helpers import ServerProcess, free_port

pytestmark = pytest.mark.timeout(180)

# vLLM's keys (vllm/benchmarks/serve.py's result), which scripts written for `vllm bench serve` read
VLLM_KEYS = {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests"}
DETAILED = {"input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors"}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--max-model-len", "512", "--no-access-log", "--log-level", "warning"]) as s:
        yield s


def _bench(server, *args) -> int:
    return main(["bench", "serve", "--base-url", server.url, "--disable-tqdm", *args])


def test_a_vllm_bench_serve_command_line_writes_vllms_keys(server, tmp_path, capsys):
    rc = _bench(server, "--backend", "vllm", "--model", "demo", "--dataset-name", "random",
                "--random-input-len", "16", "--random-output-len", "4", "--random-prefix-len", "5",
                "--num-prompts", "4", "--max-concurrency", "2", "--request-rate", "inf", "--ignore-eos",
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99.9",
                "--goodput", "ttft:600000", "tpot:600000", "--ready-check-timeout-sec", "5",
                "--save-result", "--result-dir", str(tmp_path / "out"), "--result-filename", "run.json")
    assert rc == 0, capsys.readouterr()
    res = json.loads((tmp_path / "out" / "run.json").read_text())
    assert VLLM_KEYS <= set(res) and "duration_s" not in res and not DETAILED & set(res)
    assert res["backend"] == res["endpoint_type"] == "vllm" and res["endpoint"] == "/v1/completions"
    assert res["model_id"] == "demo" and res["completed"] == 4 and res["failed"] == 0
    assert re.fullmatch(r"\d{8}-\d{6}", res["date"]) and res["request_rate"] == "inf" and res["max_concurrency"] == 2
    assert res["total_input_tokens"] == 4 * (5 + 16)     # token ids: the prefix and the prompt, exactly
    assert res["total_output_tokens"] == 4 * 4           # --ignore-eos: the drawn length
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])   # the bounds hold for all
    # (vLLM's per-second count: requests that ran at any time in the peak second, one after another too)
    assert 1 <= res["max_concurrent_requests"] <= 4 and 0 < res["max_output_tokens_per_s"] <= 4 * 4
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < res[f"p50_{m}_ms"] <= res[f"p90_{m}_ms"] <= res[f"p99.9_{m}_ms"] + 1e-9, m
        assert {f"mean_{m}_ms", f"median_{m}_ms", f"std_{m}_ms"} <= set(res)
    assert "p99_ttft_ms" not in res
    out = capsys.readouterr().out
    assert "P99.9 E2EL (ms)" in out and "Request goodput (req/s)" in out


def test_openai_chat_backend_goes_to_chat_and_save_result_names_the_file(server, tmp_path, capsys):
    rc = _bench(server, "--backend", "openai-chat", "--num-prompts", "3", "--random-input-len", "20",
                "--random-output-len", "3", "--ignore-eos", "--save-result", "--save-detailed",
                "--result-dir", str(tmp_path), "--max-concurrency", "3")
    assert rc == 0, capsys.readouterr()
    (path,) = tmp_path.glob("*.json")
    # vLLM's name: <label, else backend>-<rate>qps[-concurrency<N>]-<model>-<date>.json
    assert re.fullmatch(r"openai-chat-infqps-concurrency3-demo-\d{8}-\d{6}\.json", path.name), path.name
    res = json.loads(path.read_text())
    assert res["endpoint"] == "/v1/chat/completions" and res["completed"] == 3
    assert DETAILED <= set(res) and len(res["ttfts"]) == len(res["generated_texts"]) == 3
    assert res["output_lens"] == [3, 3, 3] and res["errors"] == [""] * 3
    assert all(isinstance(t, str) for t in res["generated_texts"])   # (the demo model may say only specials)
    assert "p99_ttft_ms" in res and "p99_e2el_ms" not in res      # vLLM's default metrics: ttft,tpot,itl


def _sharegpt_file(tmp_path):
    long_answer = "one two three four five six seven"
    data = [{"id": "a", "conversations": [{"from": "human", "value": "tell me about the tensor parallel engine"},
                                          {"from": "gpt", "value": long_answer}]},
            {"id": "b", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "too short"}]},
            {"id": "c", "conversations": [{"from": "human", "value": "only one turn here, no answer"}]},
            {"id": "d", "conversations": [{"from": "human", "value": "what does overlap of communication buy"},
                                          {"from": "gpt", "value": "it hides the all reduce behind the gemm"}]},
            "not an entry"]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def _word_tokenizer(path):
    """A whitespace word-level Hugging Face tokenizer: a token is a word, so counts are checkable by eye."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for w in "tell me about the tensor parallel engine one two three four five six seven what does "
                              "overlap of communication buy it hides all reduce behind gemm".split()})
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(path))
    return path


def test_sharegpt_from_a_local_file(server, tmp_path, capsys):
    path = _sharegpt_file(tmp_path)
    out = tmp_path / "res.json"
    tok = _word_tokenizer(tmp_path / "tok")
    rc = _bench(server, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "2",
                "--tokenizer", str(tok), "--ignore-eos", "--save-detailed", "--result-file", str(out))
    assert rc == 0, capsys.readouterr()
    res = json.loads(out.read_text())
    # b (a 1-word prompt) and c (no answer) are left out; a and d ask for their answers' word counts
    assert res["completed"] == 2 and sorted(res["output_lens"]) == [7, 8] and res["tokenizer_id"] == str(tok)
    assert res["dataset_name"] == "sharegpt" and res["dataset_path"] == str(path)

    # Without --tokenizer the server counts (the demo model: a byte tokenizer); 3 prompts of 2 usable
    # entries: drawn again, said on stderr.
    rc = _bench(server, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "3",
                "--sharegpt-output-len", "2", "--ignore-eos", "--result-file", str(out))
    assert rc == 0
    assert "has 2 usable entries for --num-prompts 3" in capsys.readouterr().err
    res = json.loads(out.read_text())
    assert res["completed"] == 3 and res["total_output_tokens"] == 6 and res["tokenizer_id"] == "demo"


def test_hugging_face_datasets_are_streamed_and_an_unreachable_hub_is_one_error(monkeypatch, capsys):
    rows = [{"question": "why overlap the all reduce with the gemm", "answer": "it hides the transfer time"},
            {"question": "hi", "answer": "short"},
            {"messages": [{"role": "user", "content": "what is a symmetric heap here"},
                          {"role": "assistant", "content": "memory every rank maps"}]}]
    calls = []

    class Stream(list):
        def shuffle(self, seed, buffer_size):
            calls.append(("shuffle", seed))
            return self

    def load_dataset(path, name=None, split=None, streaming=False):
        calls.append((path, name, split, streaming))
        if path == "org/offline":
            raise ConnectionError("Couldn't reach 'org/offline' on the Hub (LocalEntryNotFoundError)")
        return Stream([{"text": "a prompt without any answer"}] * 3 if path == "org/prompts" else rows)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    cfg = BenchServeConfig(dataset_name="hf", dataset_path="org/qa", hf_subset="main", hf_split="test",
                           num_prompts=2, seed=3)
    reqs = serve_datasets.sample_requests(cfg, count=lambda text: len(text.split()))
    assert calls[:2] == [("org/qa", "main", "test", True), ("shuffle", 3)]
    assert [(r.prompt, r.output_len) for r in reqs] == [(rows[0]["question"], 5), (rows[2]["messages"][0]["content"], 4)]

    # a prompt column alone: the output length comes from --hf-output-len
    with pytest.raises(CliError, match="has no entry with a prompt of 4-1024 tokens") as e:
        serve_datasets.sample_requests(BenchServeConfig(dataset_name="hf", dataset_path="org/prompts"), count=len)
    assert "--hf-output-len" in e.value.hint
    cfg = BenchServeConfig(dataset_name="hf", dataset_path="org/prompts", hf_output_len=6, num_prompts=2)
    assert [r.output_len for r in serve_datasets.sample_requests(cfg, count=lambda t: len(t.split()))] == [6, 6]

    with pytest.raises(CliError, match="cannot load the Hugging Face dataset org/offline .*ConnectionError") as e:
        serve_datasets.sample_requests(BenchServeConfig(dataset_name="hf", dataset_path="org/offline"), count=len)
    assert "Hub must be reachable" in e.value.hint and "--dataset-name sharegpt" in e.value.hint
    monkeypatch.setitem(sys.modules, "datasets", None)     # not installed
    with pytest.raises(CliError, match="`datasets` package, which is not installed"):
        serve_datasets.sample_requests(BenchServeConfig(dataset_name="hf", dataset_path="org/qa"), count=len)


def _config(*args) -> BenchServeConfig:
    return bench_serve_config_from_args(build_parser().parse_args(["bench", "serve", *args]))


def test_ignore_eos_is_off_unless_given_as_in_vllm():
    sample = serve_datasets.SampleRequest([1, 2, 3], 4)
    assert _config().ignore_eos is False and request_body(_config(), "m", sample)["ignore_eos"] is False
    assert request_body(_config("--ignore-eos"), "m", sample)["ignore_eos"] is True
    assert _config().route == "/v1/completions" and _config("--backend", "openai-chat").route == "/v1/chat/completions"
    chat = request_body(_config("--backend", "openai-chat"), "m", serve_datasets.SampleRequest("hi there", 4))
    assert chat["messages"] == [{"role": "user", "content": "hi there"}] and "prompt" not in chat
    cfg = _config("--percentile-metrics", "e2el,ttft", "--metric-percentiles", "25,75", "--goodput", "e2el:100")
    assert cfg.percentile_metrics == ("e2el", "ttft") and cfg.metric_percentiles == (25.0, 75.0)
    assert cfg.goodput == {"e2el": 100.0}


@pytest.mark.parametrize("args, message", [
    (["--goodput", "bogus:5"], "--goodput 'bogus:5': each objective is KEY:MILLISECONDS with KEY one of ttft, tpot, e2el"),
    (["--goodput", "ttft"], "--goodput 'ttft': each objective"),
    (["--percentile-metrics", "ttft,latency"], "--percentile-metrics: unknown latency; choose from ttft, tpot, itl, e2el"),
    (["--metric-percentiles", "50,100"], "--metric-percentiles must lie in (0, 100), got '50,100'"),
    (["--metric-percentiles", "p99"], "--metric-percentiles takes comma-separated numbers, got 'p99'"),
    (["--dataset-path", "x.json"], "--dataset-name random makes its prompts; --dataset-path is for sharegpt and hf"),
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "--backend openai-chat posts chat completions"),
    (["--random-prefix-len", "-1"], "--random-prefix-len must be >= 0"),
    (["--result-file", "a.json", "--result-dir", "d"], "--result-file names the file itself"),
    (["--dataset-name", "sharegpt", "--model", "demo"], "--dataset-name sharegpt reads a local file"),
    (["--dataset-name", "sharegpt", "--model", "demo", "--dataset-path", "/nonexistent.json"],
     "--dataset-path /nonexistent.json: No such file or directory"),
])
def test_flags_that_do_not_fit_are_one_line_errors(server, capsys, args, message):
    rc = _bench(server, *args)
    err = capsys.readouterr().err
    assert rc in (1, 2) and "Traceback" not in err
    first = err.strip().splitlines()[0]
    assert first.startswith("tp-overlap bench serve: error: ") and message in first, first


def test_the_ready_check_waits_for_the_server_then_says_so(capsys):
    t0 = time.monotonic()
    assert main(["bench", "serve", "--port", str(free_port()), "--num-prompts", "1", "--disable-tqdm",
                 "--ready-check-timeout-sec", "1.5"]) == 1
    assert time.monotonic() - t0 >= 1.4
    first = capsys.readouterr().err.strip().splitlines()[0]
    assert "cannot reach the server" in first and "within --ready-check-timeout-sec 1.5" in first
