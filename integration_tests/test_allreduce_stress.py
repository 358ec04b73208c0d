"""bench/allreduce_stress.py runs end to end (a smoke run on the CPU, eager only: the GPU run is the
real one) and reports every call it made as checked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_stress_script_smoke_run(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "allreduce_stress.py"), "--tp", "2", "--device", "cpu",
                        "--max-bytes", "32768", "--calls", "8", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=230)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (js,) = tmp_path.glob("allreduce-stress-tp2-*.json")
    res = json.loads(js.read_text())
    for rank in res["all_ranks"]:
        assert rank["eager_calls"] == 8 and sum(rank["counts"].values()) == 8
    assert res["environment"]["device"] == "cpu" and res["environment"]["torch"]
    assert (tmp_path / js.name.replace(".json", ".md")).read_text().count("every result exact") == 1
