#!/usr/bin/env bash
# Issue 29's measurements on one GPU, in one call: another checkout (BASE, a source folder, e.g.
# `git archive 7185b69 | tar -x -C base`) against this one. Both are laid out side by side as
# pyproject.toml maps them (kernels/ and serving/ inside tp_overlap_plugin/) and chosen per process
# with PYTHONPATH.
#   1. HTTP A/B, base this base this (bench/serve_timeline.py --base): output tok/s at rate inf, the
#      latency targets at rate 2, this checkout's step timeline;
#   2. this checkout at a 2048-token step budget (the chunked-prefill default against 8192);
#   3. greedy outputs of both, compared (bench/greedy_tokens.py), in float32 and bfloat16;
#   4. the engine's GPU tests; 5. the 8192-token prefill step; 6. prefill attention implementations.
# usage: bash bench/serve_ab.sh BASE_SRC OUT_DIR
set -u
BASE_SRC=$1
OUT=$2
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
this timeout 250 python3 $here/bench/serve_timeline.py $load --rates 2,inf --base /tmp/site-base --pairs 2 --tag ab 2>&1 \
  | grep -v "^|" | tail -n 30
this timeout 80 python3 $here/bench/serve_timeline.py $load --rates 32,inf --max-num-batched-tokens 2048 --tag budget2048 \
  2>&1 | grep -v "^|" | tail -n 12
# in both dtypes every id must be as it was (a kernel change that rounds differently shows in bfloat16)
for dt in float32 bfloat16; do
  base timeout 60 python3 $here/bench/greedy_tokens.py /tmp/greedy-base-$dt.json --dtype $dt 2>&1 | tail -n 1
  this timeout 60 python3 $here/bench/greedy_tokens.py /tmp/greedy-this-$dt.json --dtype $dt 2>&1 | tail -n 1
  python3 -c "import json,sys; a,b=(json.load(open(f)) for f in sys.argv[1:3]); same=sum(x==y for x,y in zip(a,b)); \
lead=[next((i for i,(p,q) in enumerate(zip(x,y)) if p!=q), len(x)) for x,y in zip(a,b)]; \
print(f'greedy {sys.argv[3]}: {same}/{len(a)} sequences identical, first difference at tokens {sorted(lead)}')" \
    /tmp/greedy-base-$dt.json /tmp/greedy-this-$dt.json $dt
done
this timeout 90 python3 -m pytest -q -c $here/pyproject.toml --rootdir $here -m gpu \
  $here/integration_tests/test_engine_hf_parity.py $here/integration_tests/test_engine_api.py 2>&1 | tail -n 4
this timeout 45 python3 $here/bench/prefill_profile.py --tp 1 --out $OUT 2>&1 | grep -E "prefill|Error" | tail -n 3
this timeout 45 python3 $here/bench/prefill_attention.py --out $OUT 2>&1 | grep -E "^\|" | tail -n 16
# the device call returns at most 8 files: the tables and timelines in one archive, the picture beside it
rm -f "$OUT"/*budget2048*.png
(cd "$OUT" && tar czf serve-ab-results.tgz *.json *.md && rm -f *.json *.md)
