#!/usr/bin/env bash
# Run every benchmark once, side by side figures in one run each (about 10-12 minutes on 2 cores).
# Extra arguments go to every script, e.g. `bench/run_all.sh --repeats 3`.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== bench/transfer.py: one tensor, ours vs raw gRPC bytes"
python bench/transfer.py "$@"
echo
echo "== bench/allreduce.py: ring all-reduce, ours vs gloo"
python bench/allreduce.py "$@"
echo
echo "== bench/pipeline.py: 3-stage pipeline, sync and async, against the schedule's bound"
python bench/pipeline.py "$@"
echo
echo "== bench/memory.py: worker peak RSS against stage memory + overhead; bounded in-flight"
python bench/memory.py "$@"
echo
echo "== bench/e2e.py: examples/digits.yaml end to end, samples/s and time shares per worker"
python bench/e2e.py "$@"
echo
echo "== bench/planner.py: our plan vs a Ravnest-style plan (same cost model); planning time"
python bench/planner.py
