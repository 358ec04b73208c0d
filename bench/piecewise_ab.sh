#!/usr/bin/env bash
# Piecewise CUDA graphs (issue 29 item 3) on one GPU, in one call: the engine's GPU tests of the
# piecewise path, eager vs piecewise steps side by side (bench/piecewise_steps.py), then HTTP A/B
# against another checkout without them (BASE_SRC, e.g. `git archive 0ea8ea7 | tar -x -C base`),
# base this, at rates 2 and inf (bench/serve_timeline.py, as bench/serve_ab.sh lays the two out).
# usage: bash bench/piecewise_ab.sh BASE_SRC OUT_DIR
set -u
BASE_SRC=$1
OUT=$2
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1 TP_OVERLAP_SHARE_GPUS=1
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -s "$here/integration_tests/test_engine_piecewise.py" \
  --durations=5 2>&1 | grep -E "passed|failed|FAILED|Error|TP=2|s call" | head -20
timeout 150 python3 "$here/bench/piecewise_steps.py" --model llama-3-8b --rounds 8 --out "$OUT" 2>&1 | grep -E "^\||Graphs|Engine|Error"
inst() { mkdir -p "$1" && cp -r "$2/tp_overlap_plugin" "$1/" && cp -r "$2/kernels" "$2/serving" "$1/tp_overlap_plugin/"; }
inst /tmp/site-base "$BASE_SRC" && inst /tmp/site-this "$here" || exit 1
P0=${PYTHONPATH:-}
cd /tmp
PYTHONPATH=/tmp/site-this:$P0 timeout 330 python3 "$here/bench/serve_timeline.py" --tp 1 --level-seconds 6 \
  --min-requests 12 --inf-requests 200 --warmup-requests 64 --out "$OUT" --rates 2,inf --base /tmp/site-base \
  --pairs 1 --tag piecewise-ab 2>&1 | grep -v "^|" | tail -n 30
