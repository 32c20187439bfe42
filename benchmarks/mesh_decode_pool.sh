#!/usr/bin/env bash
# `kvmesh up` (1 prefill + 1 decode worker, 256 MiB of KV each, float32) at concurrency 32
# under `vllm bench serve` (64 prompts of 128 random tokens, 128 out, --ignore-eos), two
# rounds on one mesh; after each round every worker's preemptions and the router's retries
# (overloaded: a decode worker found no room for a pull in time). Runs the code of TREE
# (default: this checkout; a baseline worktree needs shared/kvmesh/services linked to
# ../../services, see benchmarks/vllm_serving_bench.py's check_services_from), with this
# checkout's .venv and .venv-vllm. Alternate trees in one sitting to compare them:
#   for t in . /tmp/base . /tmp/base; do TREE=$t benchmarks/mesh_decode_pool.sh; done
set -u
cd "$(dirname "$0")/.."
TREE=$(cd "${TREE:-.}" && pwd)
W=$(mktemp -d /tmp/kvmesh-pool-XXXX)
echo "tree $TREE $(git -C "$TREE" rev-parse --short HEAD) dirty=$(git -C "$TREE" status --short | grep -c .)"
echo "cpu $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) cores $(nproc) flags: $(grep -m1 -o -w -E 'avx512f|avx512_bf16|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
PYTHONPATH=$TREE/shared .venv/bin/python -m kvmesh.cli up --port 0 --kv-cache-mib 256 --dtype float32 --workdir "$W/mesh" "$@" > "$W/up.log" 2>&1 &
UP=$!
for _ in $(seq 1 120); do grep -q "kvmesh is serving at" "$W/up.log" && break; sleep 1; done
URL=$(grep -o "serving at http://[^ ]*/v1" "$W/up.log" | head -1 | sed 's/serving at //; s#/v1##')
echo "url $URL"
sleep 3
MODEL=$(curl -s "$URL/v1/models" | python3 -c 'import sys,json; print(json.load(sys.stdin)["data"][0]["id"])')
TOK=$(.venv/bin/python -c 'from kvmesh.engine.loader.default_model import resolve_model; print(resolve_model(None))')
for round in 1 2; do
  .venv-vllm/bin/python -c "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))" \
    --backend openai --base-url "$URL" --endpoint /v1/completions --model "$MODEL" --tokenizer "$TOK" --dataset-name random \
    --random-input-len 128 --random-output-len 128 --ignore-eos --num-prompts 64 --max-concurrency 32 --seed $round \
    --percentile-metrics ttft,itl --metric-percentiles 50,99 --temperature 0 --disable-tqdm 2>&1 | grep -E "Successful|Failed|Output token throughput|TTFT|ITL|Benchmark duration"
  for port in $(grep -h "health checks on" -r "$W/mesh/logs" | grep -o "127.0.0.1:[0-9]*"); do
    echo "worker $port: $(curl -s "http://$port/metrics" | grep -E '^kvmesh:(num_preemptions_total|kv_blocks_reserved_for_growth|num_requests_running)' | tr '\n' ' ')"
  done
  echo "router: $(curl -s "$URL/metrics" | grep -E '^kvmesh:router_(retries_total|routing_decisions_total)' | tr '\n' ' ')"
done
kill $UP; wait $UP
echo "logs $W"
