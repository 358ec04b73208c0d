"""The console script's subcommands as a user runs them (the README's commands)."""

import argparse
import json
import subprocess
import sys

import pytest
import torch

from tp_overlap_plugin.serving.user_errors import CliError
from tp_overlap_plugin.cli.main import build_parser, main
from serving_helpers import free_port


@pytest.mark.timeout(180)
def test_demo_subcommand_all_reduces_correctly():
    proc = subprocess.run([sys.executable, "-m", "tp_overlap_plugin.cli", "demo", "--tp", "2", "--iters", "2"],
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-2000:]
    errors = [float(line.split("rel. error ")[1].split(",")[0]) for line in proc.stdout.splitlines()
              if "rel. error" in line]
    assert len(errors) == 2 and errors[0] < 1e-6 and errors[1] < 1e-2
    assert "'all_reduce.one_shot': 4" in proc.stdout


@pytest.mark.timeout(180)
def test_bench_throughput_reports_every_token(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "throughput", "--model", "demo", "--num-prompts", "4", "--input-len", "12",
                 "--output-len", "5", "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["num_requests"] == 4
    assert res["output_tokens_per_s"] * res["elapsed_s"] == pytest.approx(20)
    assert res["ttft_ms"]["median"] > 0 and res["tpot_ms"]["median"] > 0
    # A table on stdout; the JSON only in the file.
    table = capsys.readouterr().out
    assert "{" not in table and "tp-overlap bench throughput" in table
    assert f"{'Output throughput (tok/s)':<40}{res['output_tokens_per_s']:>16.2f}" in table

    assert main(["bench", "latency", "--input-len", "4", "--output-len", "1", "--iters", "2"]) == 0
    table = capsys.readouterr().out
    assert "{" not in table and "Median TTFT (ms)" in table and "Iterations" in table


def _error_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()


def test_bad_tp_is_a_clear_error(capsys):
    assert main(["demo", "--tp", "0"]) == 2
    assert "--tp must be >= 1" in capsys.readouterr().err


def _leaf_parsers(parser, path=()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for sub in subs:
        for name, p in sub.choices.items():
            yield from _leaf_parsers(p, (*path, name))


def test_every_subcommand_help_shows_the_defaults():
    leaves = dict(_leaf_parsers(build_parser()))
    assert set(leaves) == {("demo",), ("generate",), ("serve",), ("tune",), ("bench", "serve"), ("bench", "throughput"),
                           ("bench", "latency")}
    for path, p in leaves.items():
        for a in p._actions:
            if not a.option_strings or a.default in (None, argparse.SUPPRESS) or a.dest == "help":
                continue
            f = p._get_formatter()
            f.add_argument(a)
            rendered = " ".join(f.format_help().split())
            assert rendered.endswith(f"(default: {a.default})"), (path, rendered)
    assert "see above" not in leaves[("bench", "serve")].format_help()


def test_serve_help_explains_the_flag(monkeypatch):
    # issue 40: --help named neither --tp-overlap-config's keys nor that the flag runs stock until `tune`
    import dataclasses

    from tp_overlap_plugin.options import TPOverlapOptions

    monkeypatch.setenv("COLUMNS", "10000")     # nothing wrapped at a hyphen
    leaves = dict(_leaf_parsers(build_parser()))
    for command in (("serve",), ("generate",)):
        text = " ".join(leaves[command].format_help().split())
        flag = text.split("--tp-overlap ", 1)[1].split(" --")[0]
        assert "until `tp-overlap tune` has made one here" in flag and "runs the stock path" in flag
        options = text.split("--tp-overlap-config JSON ", 1)[1]
        for key in {f.name for f in dataclasses.fields(TPOverlapOptions)} - {"enabled"}:
            assert f" {key} (" in options, key
        assert 'dispatch ("table" | "overlap" | "stock", default "table")' in options


def test_command_line_errors_are_one_line_and_a_hint(capsys):
    # Each of these printed a traceback, or the whole usage block.
    assert main(["serve", "--tp-overlap-config", "notjson"]) == 2
    error, hint = _error_lines(capsys)
    assert error.startswith("tp-overlap serve: error: --tp-overlap-config is not valid JSON") and "'notjson'" in error
    assert hint.startswith("  hint: ") and '{"dispatch": "overlap"}' in hint

    assert main(["bench", "serve", "--port", str(free_port()), "--num-prompts", "2", "--disable-tqdm"]) == 1
    error, hint = _error_lines(capsys)
    assert error.startswith("tp-overlap bench serve: error: cannot reach the server at http://127.0.0.1:")
    assert "tp-overlap serve" in hint and "--base-url" in hint

    assert main(["generate", "--max-num-seqs", "0"]) == 2
    error, hint = _error_lines(capsys)
    assert error == "tp-overlap generate: error: --max-num-seqs: Input should be greater than or equal to 1 (got 0)"

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--no-such-option"])
    assert exit_.value.code == 2
    error, hint = _error_lines(capsys)
    assert "unrecognized arguments: --no-such-option" in error and "--help" in hint

    # Said in the options' terms before anything starts (issue 40: a torch internal, a bare ValueError,
    # "pass load_format='dummy'")
    assert main(["generate", "--tp", "3"]) == 2
    assert _error_lines(capsys) == ["tp-overlap generate: error: --tp 3 does not divide the model's 4 attention "
                                    "heads, 2 KV heads, 256 MLP columns (intermediate_size); --tp can be 1, 2"]
    assert main(["serve", "--tp", "3"]) == 2 and "--tp 3 does not divide" in _error_lines(capsys)[0]
    assert main(["serve", "--model", "llama-3-8b"]) == 2
    error, hint = _error_lines(capsys)
    assert error.startswith("tp-overlap serve: error: --model llama-3-8b: no weights (*.safetensors) in ")
    assert hint == "  hint: --load-format dummy runs it with random weights"
    if not torch.cuda.is_available():
        assert main(["serve", "--device", "cuda"]) == 2
        error, hint = _error_lines(capsys)
        assert error.startswith("tp-overlap serve: error: --device cuda: torch sees no GPU on this machine"), error
        assert "--device cpu" in hint

    # --debug: the exception itself, traceback and all
    with pytest.raises(CliError, match="not valid JSON"):
        main(["serve", "--tp-overlap-config", "notjson", "--debug"])


@pytest.mark.timeout(120)
def test_serve_on_a_busy_port_ends_with_one_error_line():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "tp_overlap_plugin.cli", "serve", "--port", str(port),
                               "--max-model-len", "64", "--log-level", "warning"],
                              capture_output=True, text=True, timeout=110)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    *_, error, hint = proc.stderr.strip().splitlines()
    assert error.startswith(f"tp-overlap serve: error: the server could not listen on 127.0.0.1:{port}"), error
    assert hint == "  hint: choose another --port, or stop what uses it"


def test_serve_checks_its_port_before_loading_the_engine(monkeypatch, capsys):
    import socket

    from tp_overlap_plugin.serving.config import EngineConfig
    from tp_overlap_plugin.serving.engine import async_llm as engine
    from tp_overlap_plugin.serving.entrypoints.openai.api_server import serve_main
    from tp_overlap_plugin.serving.entrypoints.openai.server_config import ServerConfig

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--port", "99999"])
    assert exit_.value.code == 2
    error, hint = _error_lines(capsys)
    assert error.endswith("argument --port: 99999 is not a TCP port: it must be in 0-65535"), error

    def no_engine(*args, **kw):
        raise AssertionError("the engine was started before the port was checked")

    monkeypatch.setattr(engine, "AsyncLLM", no_engine)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1
        # (issue 53: the server itself takes typed configs, as a program would call it)
        with pytest.raises(CliError, match=f"could not listen on 127.0.0.1:{port}"):
            serve_main(EngineConfig(), ServerConfig(port=port))
    error, hint = _error_lines(capsys)
    assert error == f"tp-overlap serve: error: the server could not listen on 127.0.0.1:{port}: Address already in use"


def test_readme_installs_from_the_checkout_and_has_a_gpu_quick_start():
    """Issue 40: the vLLM section installed `tp-overlap` from the package index, where it is not; the one
    quick start replaced a GPU machine's torch; nothing said how long pytest takes or how to run one file."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    installs = re.findall(r"pip install [^\n`&#]*", readme)
    from_index = [line for line in installs if re.search(r"(?<![/\w.-])tp-overlap(?![/\w-])", line)]
    assert installs and not from_index, from_index
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", quick, re.DOTALL)
    gpu = next(b for b in blocks if "--tp-overlap" in b)
    assert "pip install -e" in gpu and "torch" not in gpu.split("#")[0] and "tp-overlap tune" in gpu
    flat = " ".join(quick.split())  # a sentence may break its line anywhere
    assert re.search(r"takes (about )?\d+(-\d+)? minutes on 2 cores", flat) and "pytest integration_tests/test_" in flat


def test_the_options_make_the_typed_configs():
    """Issue 53: the command line is read in tp_overlap_plugin/cli/ alone; the server and the benchmarks take
    typed configs, and the options make exactly those (their defaults are the configs' own)."""
    from tp_overlap_plugin.cli.bench import offline_config_from_args
    from tp_overlap_plugin.cli.serve import server_config_from_args
    from tp_overlap_plugin.serving.benchmarks.offline import OfflineBenchConfig
    from tp_overlap_plugin.serving.entrypoints.openai.server_config import ServerConfig

    p = build_parser()
    args = p.parse_args(["serve", "--port", "9", "--no-access-log", "--served-model-name", "x",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--log-level", "debug"])
    assert server_config_from_args(args) == ServerConfig(port=9, access_log=False, served_model_name="x",
                                                         tool_parser="hermes", log_level="debug")
    assert server_config_from_args(p.parse_args(["serve"])) == ServerConfig()
    assert offline_config_from_args(p.parse_args(["bench", "latency", "--iters", "2"])) == \
        OfflineBenchConfig(mode="latency", iters=2)
    assert offline_config_from_args(p.parse_args(["bench", "throughput", "--dataset", "lognormal"])) == \
        OfflineBenchConfig(dataset="lognormal")
