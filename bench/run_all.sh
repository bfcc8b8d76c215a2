#!/usr/bin/env bash
# Run every benchmark once, side by side figures in one run each (about 15 minutes on 2 cores).
# Extra arguments go to the scripts that time repeats (transfer, allreduce, pipeline, memory, e2e,
# seed),
# e.g. `bench/run_all.sh --repeats 3`. Writes bench/out/transfer.csv and docs/throughput.png.
# bench/wan.py makes network namespaces: as root it runs, otherwise it is reported as not run.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/out
start=$SECONDS

echo "== bench/transfer.py: one tensor, ours vs raw gRPC bytes vs gloo, by message size"
python bench/transfer.py --sizes 0.0625 0.25 1 4 16 64 --csv bench/out/transfer.csv "$@"
python bench/plot.py bench/out/transfer.csv docs/throughput.png
echo "(plot: docs/throughput.png)"
echo
echo "== bench/allreduce.py: ring all-reduce, ours vs gloo"
python bench/allreduce.py "$@"
echo
echo "== bench/socket_ring.py: the same ring on plain TCP sockets vs gloo (prototype: no auth)"
python bench/socket_ring.py --repeats 3 --bf16
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
echo "== bench/seed.py: the seed API (clusterize, Node, Trainer) vs ravnest run, digits 1 x 3"
python bench/seed.py "$@"
echo
echo "== bench/planner.py: our plan vs a Ravnest-style plan (same cost model); planning time"
python bench/planner.py
echo
echo "== bench/elastic.py: one failure, elastic recovery vs whole-job restart (steps lost)"
python bench/elastic.py
echo
echo "== bench/wan.py: ring and send over rate-limited, delayed links vs the paper model"
python bench/wan.py --model-only
if [[ $(id -u) == 0 ]]; then
    python bench/wan.py --ranks 2 3 --delays 0 50 150 --rates 1000 --size 24 --rounds 2 --lanes 0 4 \
        --transports grpc tcp
    echo "-- bf16 against fp32 on the wire where the link, not the CPU, is the limit"
    python bench/wan.py --ranks 2 3 --delays 20 --rates 100 1000 --size 24 --rounds 2 --wires none bf16 \
        --transports grpc tcp
    echo
    echo "== bench/bandwidth.py: bandwidth-aware plan vs one ignoring bandwidth, on tbf links"
    python bench/bandwidth.py
else
    echo "bench/wan.py, bench/bandwidth.py: NOT RUN (need root for network namespaces)"
fi
echo
echo "== all benchmarks: $((SECONDS - start)) s"
