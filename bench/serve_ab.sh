#!/usr/bin/env bash
# Issue 29's measurements on one GPU, in one call: another checkout (BASE, a source folder, e.g.
# `git archive 7185b69 | tar -x -C base`) against this one. Both are laid out side by side as
# pyproject.toml maps them (kernels/ and serving/ inside tp_overlap_plugin/) and chosen per process
# with PYTHONPATH.
#   1. HTTP A/B, base this base this (bench/serve_timeline.py --base) at rates 2, 8, 32 and inf: output
#      tok/s, the latency targets at rate 2 against the idle probe, both engines' step timelines;
#   2. this checkout at the engine's default 2048-token step budget (the A/B runs at 8192);
#   3. greedy outputs of both, compared (bench/greedy_tokens.py --top2 / --compare), float32 and bfloat16;
#   4. the engine's GPU tests; 5. the 8192-token prefill step, synchronous and with async scheduling;
#   6. prefill attention implementations; 7. gate_up + SiLU-mul fused or not, and the prefill step on the
#   flag's path; 8. decode steps at batch 1, 8 and 32 against their floor.
#   PART (default all) picks a part, to fit the device's 10-minute call: http (1), checks (3, 4) or
#   perf (2, 5, 6).
# usage: bash bench/serve_ab.sh BASE_SRC OUT_DIR [all|http|checks|perf]
set -u
BASE_SRC=$1
OUT=$2
PART=${3:-all}
here=$(cd "$(dirname "$0")/.." && pwd)
inst() { mkdir -p "$1" && cp -r "$2/tp_overlap_plugin" "$1/" && cp -r "$2/kernels" "$2/serving" "$1/tp_overlap_plugin/"; }
inst /tmp/site-base "$BASE_SRC" && inst /tmp/site-this "$here" || exit 1
export PYTHONUNBUFFERED=1
P0=${PYTHONPATH:-}
this() { PYTHONPATH=/tmp/site-this:$P0 "$@"; }
base() { PYTHONPATH=/tmp/site-base:$P0 "$@"; }
# Out of the checkout: `python -m` puts the working folder first on sys.path, and the checkout's own
# tp_overlap_plugin/ (without serving/ inside) would shadow both installs.
cd /tmp
base python3 -c "import tp_overlap_plugin.serving.engine as e; print('base engine:', e.__file__)"
this python3 -c "import tp_overlap_plugin.serving.engine as e; print('this engine:', e.__file__)"
load="--tp 1 --level-seconds 6 --min-requests 12 --inf-requests 200 --warmup-requests 64 --out $OUT"
part() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }
if part http; then
  this timeout 470 python3 $here/bench/serve_timeline.py $load --rates 2,8,32,inf --base /tmp/site-base --pairs 2 \
    --tag ab 2>&1 | grep -v "^|" | tail -n 40
fi
if part perf; then
  this timeout 110 python3 $here/bench/serve_timeline.py $load --rates 32,inf --max-num-batched-tokens 2048 \
    --tag budget2048 2>&1 | grep -v "^|" | tail -n 12
  rm -f "$OUT"/*budget2048*.png
  this timeout 60 python3 $here/bench/prefill_profile.py --tp 1 --out $OUT 2>&1 | grep -E "prefill|Error" | tail -n 3
  this timeout 60 python3 $here/bench/prefill_profile.py --tp 1 --prompts 16 --async-scheduling --tag async --out $OUT \
    2>&1 | grep -E "prefill|Error" | tail -n 3
  this timeout 60 python3 $here/bench/prefill_attention.py --out $OUT 2>&1 | grep -E "^\|" | tail -n 16
  # gate_up with its SiLU-mul in our GEMM's epilogue against cuBLAS + the kernel; its rows into the
  # shipped TP=1 table, and the 8192-token prefill step on the flag's path with that table
  this timeout 150 python3 $here/bench/gemm_silu_mul.py --out $OUT --into-table \
    $here/tp_overlap_plugin/dispatch_tables/h100-tp1.json --table-out $OUT/h100-tp1-silu.json 2>&1 | grep -E "^\||Error" | tail -n 16
  this timeout 90 python3 $here/bench/prefill_profile.py --tp 1 --prompts 16 --async-scheduling --tp-overlap \
    --dispatch-table $OUT/h100-tp1-silu.json --tag async-overlap --out $OUT 2>&1 | grep -E "prefill|Error" | tail -n 3
  # the small-batch decode steps that the rate-inf level's tail is made of, against the weight + KV floor
  this timeout 120 python3 $here/bench/decode_profile.py --tp 1 --batch 1,8,32 --sched async --no-attention \
    --out $OUT 2>&1 | grep -E "^\|" | tail -n 12
fi
if part checks; then
  # in both dtypes: every id as it was, or a divergence at a near-tie of the old engine (the top-2 gap)
  for dt in float32 bfloat16; do
    base timeout 60 python3 $here/bench/greedy_tokens.py /tmp/greedy-base-$dt.json --dtype $dt --top2 2>&1 | tail -n 1
    this timeout 60 python3 $here/bench/greedy_tokens.py /tmp/greedy-this-$dt.json --dtype $dt --top2 2>&1 | tail -n 1
    echo "greedy $dt:"; python3 $here/bench/greedy_tokens.py --compare /tmp/greedy-base-$dt.json /tmp/greedy-this-$dt.json \
      | tail -n 20
  done
  this timeout 150 python3 -m pytest -q -c $here/pyproject.toml --rootdir $here -m gpu -rfE \
    $here/integration_tests/test_engine_hf_parity.py $here/integration_tests/test_engine_api.py \
    $here/integration_tests/test_engine_piecewise.py $here/integration_tests/test_engine_triton_attention.py 2>&1 | tail -n 6
  # a dead worker under graph-replayed decode, the flag on, two ranks on this one GPU
  TP_OVERLAP_SHARE_GPUS=1 this timeout 200 python3 -m pytest -q -c $here/pyproject.toml --rootdir $here -m gpu -rfE \
    $here/integration_tests/test_engine_dead_peer.py 2>&1 | tail -n 8
fi
# the device call returns at most 8 files: the tables and timelines in one archive, the pictures beside it
(cd "$OUT" && tar czf serve-ab-results-$PART.tgz *.json *.md && rm -f *.json *.md)
