#!/usr/bin/env bash
# The engine-core process (serving/engine_core.py) against the engine loop on a thread of the HTTP
# process (BASE, a source folder: main before the change), over HTTP at TP=1, in one call: output tok/s
# and the step timeline at rates 8 and inf (bench/serve_timeline.py --base, runs base this base this),
# then, per engine, the host launch time of CUDA-graph decode steps by running batch, from the same
# runs' step records (both engines write them).
# usage: bash bench/serve_core_ab.sh BASE_SRC OUT_DIR
set -u
BASE_SRC=$1
OUT=$2
here=$(cd "$(dirname "$0")/.." && pwd)
inst() { mkdir -p "$1" && cp -r "$2/tp_overlap_plugin" "$1/" && cp -r "$2/kernels" "$2/serving" "$1/tp_overlap_plugin/"; }
inst /tmp/site-base "$BASE_SRC" && inst /tmp/site-this "$here" || exit 1
export PYTHONUNBUFFERED=1
P0=${PYTHONPATH:-}
this() { PYTHONPATH=/tmp/site-this:$P0 "$@"; }
# Out of the checkout: its own tp_overlap_plugin/ (without serving/ inside) would shadow both installs.
cd /tmp
load="--tp 1 --level-seconds 6 --min-requests 12 --inf-requests 200 --warmup-requests 64 --idle-requests 4 --out $OUT"
this timeout 420 python3 $here/bench/serve_timeline.py $load --rates 8,inf --base /tmp/site-base --pairs 2 --tag core-ab \
  2>&1 | grep -v "^|" | tail -n 30
python3 - "$OUT" <<'PY'
import glob, json, statistics, sys
path = sorted(glob.glob(f"{sys.argv[1]}/serve-timeline-*core-ab*.json"))[-1]
d = json.load(open(path))
print("decode steps (graph) by running batch: engine pair level | steps | launch ms p50 | GPU span ms p50 | launch/GPU")
for r in d["runs"]:
    for lv, steps in r["steps"].items():
        for lo, hi in ((1, 8), (32, 95), (96, 128)):
            ks = [s for s in steps if s["kind"] == "decode" and lo <= s["seqs"] <= hi and s.get("gpu_ms")]
            if len(ks) < 5:
                continue
            la = statistics.median(s["launch_ms"] for s in ks)
            g = statistics.median(s["gpu_ms"] for s in ks)
            print(f"{r['engine']} #{r['pair'] + 1} rate {lv} batch {lo}-{hi} | {len(ks)} | {la:.2f} | {g:.2f} | {la / g:.2f}")
PY
(cd "$OUT" && tar czf serve-core-ab-results.tgz *.json *.md && rm -f *.json *.md)
