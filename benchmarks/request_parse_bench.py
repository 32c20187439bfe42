"""What a request's message handling costs on a service's event loop, this tree against
another checkout (the code before a change), side by side in one run.

Each measure runs in a fresh process per tree (``PYTHONPATH=<tree>/shared``; the baseline
tree needs ``shared/kvmesh/services`` linked to its ``services``, as
``vllm_interleaved_bench.py --baseline-tree`` says), the trees alternating round by round;
the best of each round's repeats, then the median of the rounds:

- the router's check of a completion request whose prompt is token ids, as the HTTP layer
  runs it: ``json.loads``, then ``CompletionRequest`` validated, then the ids range-checked
  (``_prompt_ids``), for prompts of several lengths;
- a prefill worker's answer as the router decodes it (``PrefillResponse``, with a KV handle
  and its layout), and the KV handle as the worker builds it.

    .venv/bin/python benchmarks/request_parse_bench.py --baseline-tree /work/wt-base \\
        --json docs/benchmarks-request-parse.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

# Run in the child, against whichever tree's kvmesh is first on its path.
CHILD = r"""
import json, sys, timeit
from kvmesh.protocol import KVHandle, KVLayoutSpec, PrefillResponse
from kvmesh.services.router.openai_api import CompletionRequest
from kvmesh.services.router.prompts import _prompt_ids
from kvmesh.transfer.layout import block_major

lengths, repeat = json.loads(sys.argv[1]), int(sys.argv[2])


class Vocab:  # what _prompt_ids reads of a tokenizer for token ids
    vocab_size = 49152


def best_us(work, number):
    return min(timeit.repeat(work, number=number, repeat=repeat)) / number * 1e6


out = {}
for n in lengths:
    raw = json.dumps({"model": "m", "prompt": [100 + (7 * i) % 40000 for i in range(n)], "max_tokens": 8, "stream": True})

    def check():
        request = CompletionRequest.model_validate(json.loads(raw))
        _prompt_ids(request.prompts[0], Vocab, 1 << 20)

    number = max(1, 20000 // n)
    out[f"completion_{n}_ids_us"] = best_us(check, number)
    out[f"json_loads_{n}_ids_us"] = best_us(lambda: json.loads(raw), number)
layout = block_major(dtype="float32", block_size=16, num_blocks=4096, num_layers=30, num_kv_heads=3, head_dim=64, base_address=1 << 32)


def handle():
    return KVHandle(
        prefill_worker_id="prefill-1", transfer_endpoint="127.0.0.1:15000", kv_base_address=1 << 32,
        layout=KVLayoutSpec.from_layout(layout), block_ids=tuple(range(8)), num_tokens=128,
        pin_key="kvmesh/default/pins/prefill-1/r", pin_token="t" * 32, producer_started_at=1.0, pin_ttl=30.0,
    )


answer = PrefillResponse(request_id="r-0", first_token_id=42, kv=handle()).encode()
out["kv_handle_built_us"] = best_us(handle, 2000)
out["prefill_answer_decoded_us"] = best_us(lambda: PrefillResponse.decode(answer), 2000)
print(json.dumps(out))
"""


def measure(tree: Path, lengths: list[int], repeat: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree / "shared")}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(lengths), str(repeat)],
        env=env, cwd=tree, capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-tree", type=Path, required=True, help="a checkout of the code before")
    parser.add_argument("--lengths", default="128,4000,32000", help="prompt lengths in token ids")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=5, help="repeats per measure in a round (the best is kept)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    trees = {"this tree": HERE, "baseline": args.baseline_tree.resolve()}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            rounds[name].append(measure(trees[name], lengths, args.repeat))
    medians = {name: {key: statistics.median(run[key] for run in runs) for key in runs[0]} for name, runs in rounds.items()}
    from kvmesh.machine import cpu_flags, cpu_model

    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "flags": cpu_flags(), "cores": os.cpu_count(), "python": platform.python_version()},
        "baseline_tree": str(args.baseline_tree),
        "median_us": medians,
        "rounds": rounds,
    }
    print("| measure (µs, median of rounds) | this tree | baseline | baseline / this |")
    print("|---|---:|---:|---:|")
    for key in medians["this tree"]:
        this, base = medians["this tree"][key], medians["baseline"][key]
        print(f"| {key} | {this:.1f} | {base:.1f} | {base / this:.2f}× |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
