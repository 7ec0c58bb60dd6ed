#!/usr/bin/env bash
# Device series: the whole test suite as `make test` runs it on a GPU (16 processes).
. devrun/env.sh
W=/root/suite; rm -rf $W; mkdir -p $W
t0=$SECONDS
PYTEST_ARGS="-rfE --timeout 400" timeout -k 10 570 make test > $W/tests.log 2>&1
echo "make test rc=$? in $((SECONDS - t0)) s" | tee -a $W/tests.log
tail -4 $W/tests.log
grep -E "^(FAILED|ERROR)" $W/tests.log | head -30
tar czf $OUT/suite.tgz -C $W .
