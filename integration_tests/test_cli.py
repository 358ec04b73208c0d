"""The console script's subcommands as a user runs them (the README's commands)."""

import json
import subprocess
import sys

import pytest

from tp_overlap_plugin.serving.cli import main


@pytest.mark.timeout(180)
def test_demo_subcommand_all_reduces_correctly():
    proc = subprocess.run([sys.executable, "-m", "tp_overlap_plugin.serving.cli", "demo", "--tp", "2", "--iters", "2"],
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-2000:]
    errors = [float(line.split("rel. error ")[1].split(",")[0]) for line in proc.stdout.splitlines()
              if "rel. error" in line]
    assert len(errors) == 2 and errors[0] < 1e-6 and errors[1] < 1e-2
    assert "'all_reduce.one_shot': 4" in proc.stdout


@pytest.mark.timeout(180)
def test_bench_throughput_reports_every_token(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "throughput", "--model", "demo", "--num-prompts", "4", "--input-len", "12",
                 "--output-len", "5", "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["num_requests"] == 4
    assert res["output_tokens_per_s"] * res["elapsed_s"] == pytest.approx(20)
    assert res["ttft_ms"]["median"] > 0 and res["tpot_ms"]["median"] > 0


def test_bad_tp_is_a_clear_error(capsys):
    assert main(["demo", "--tp", "0"]) == 2
    assert "--tp must be >= 1" in capsys.readouterr().err
