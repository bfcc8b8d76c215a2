#!/usr/bin/env bash
# Run every benchmark once, side by side figures in one run each (about 2-4 minutes on 2 cores).
# Extra arguments go to both scripts, e.g. `bench/run_all.sh --repeats 3`.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== bench/transfer.py: one tensor, ours vs raw gRPC bytes"
python bench/transfer.py "$@"
echo
echo "== bench/allreduce.py: ring all-reduce, ours vs gloo"
python bench/allreduce.py "$@"
