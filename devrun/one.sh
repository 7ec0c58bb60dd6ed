#!/usr/bin/env bash
# Device series: one test file on the GPU (after bash devrun/half1.sh), as make test runs it.
. devrun/env.sh
python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -5
