#!/usr/bin/env bash
# throwaway: verify the launch-cost change on the GPU and A/B it against bae92bd
T=${TMPDIR:-/tmp}; t0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --target $T/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:$T/site PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
export XDG_CACHE_HOME=$T/kvmove-cache
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs -m "not multi_gpu" --junitxml=$OUT/gpu_tests.xml tests/gpu > $OUT/gpu_tests.log 2>&1
tail -4 $OUT/gpu_tests.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | head
echo "tests done at $((SECONDS-t0)) s"
calls() {  # $1 tree, $2 run
  (cd $1 && PYTHONPATH=.:$T/site timeout 120 python3 -m bench.bench_calls --quick --device cuda \
     --caches stacked per_layer --pages 1 16 128 --page-tokens 1 64 --json $OUT/calls-$3-$2.json \
     > $OUT/calls-$3-$2.log 2>&1); echo "calls $3 $2 rc=$? at $((SECONDS-t0)) s"
}
calls .prof/base 1 base; calls . 1 head
if [ $((SECONDS-t0)) -lt 300 ]; then calls .prof/base 2 base; calls . 2 head; fi
timeout 60 python3 .prof/prof.py > $OUT/prof.log 2>&1; grep "====" $OUT/prof.log
timeout 90 python3 .prof/prefetch.py > $OUT/prefetch.log 2>&1; grep "====" $OUT/prefetch.log
grep -h "adds\|prefetch return\|layerwise over\|one page" $OUT/calls-*.log
