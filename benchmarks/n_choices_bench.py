"""``n=4`` against four separate requests of the same prompt, through one local mesh.

One mesh (router, a prefill and a decode worker, kv-metadata) on the default model. Each
round takes a fresh prompt per side (so no side finds another's blocks cached) and times,
in turn (the order rotating each round), until every answer is complete:

- ``n=4``: one request with ``n=4`` (its first choice prefills; the other three start at its
  first token and reuse the prompt's full blocks from the prefill worker's prefix cache);
- four separate requests sent one after another (the second to fourth find the first's
  blocks cached too: what a client looping over requests gets);
- four separate requests sent at once (the prefill worker takes them a step apart, so the
  later ones find the first's blocks cached as well);
- four concurrent requests of four different prompts: nothing can be shared (what ``n=4``
  would cost were the prompt prefilled once per choice).

Sampled (temperature 1, a seed), ``ignore_eos`` so that every choice has the same length.

    .venv/bin/python benchmarks/n_choices_bench.py --json docs/benchmarks-n-choices.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import torch

from kvmesh.engine.loader.default_model import resolve_model
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.infra.local_mesh import LocalMesh, MeshOptions
from kvmesh.machine import cpu_model

logger = logging.getLogger("n_choices_bench")

MODEL = "SmolLM2-135M-Instruct"
N = 4


WORDS = "farms bridges markets roads hills mills towns forests lakes orchards ferries castles".split()


def prompt_for(tokenizer: Tokenizer, index: int, length: int) -> list[int]:
    """A fresh prompt of ``length`` tokens: numbered notes, not one sentence repeated (which
    would make the continuation nearly certain, and sampled choices alike)."""
    notes = [f"Note {index}.{i}: the valley has {i * 7 % 97} {WORDS[(i * 5 + index) % len(WORDS)]}." for i in range(400)]
    return tokenizer.encode(" ".join(notes) + " Now write a story about the valley:")[-length:]


async def completion(client: httpx.AsyncClient, prompt: list[int], args: argparse.Namespace, n: int, seed: int) -> dict:
    body = {
        "model": MODEL, "prompt": prompt, "max_tokens": args.new_tokens, "temperature": 1.0, "seed": seed,
        "ignore_eos": True, "n": n,
    }  # fmt: skip
    response = await client.post("/v1/completions", json=body)
    response.raise_for_status()
    answer = response.json()
    assert len(answer["choices"]) == n and answer["usage"]["completion_tokens"] == n * args.new_tokens
    return answer


async def side_n(client: httpx.AsyncClient, prompt: list[int], args: argparse.Namespace) -> tuple[float, int]:
    started = time.perf_counter()
    answer = await completion(client, prompt, args, N, 1)
    return time.perf_counter() - started, len({c["text"] for c in answer["choices"]})


async def side_sequential(client: httpx.AsyncClient, prompt: list[int], args: argparse.Namespace) -> tuple[float, int]:
    started = time.perf_counter()
    answers = [await completion(client, prompt, args, 1, 1 + j) for j in range(N)]
    return time.perf_counter() - started, sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)


async def side_concurrent(client: httpx.AsyncClient, prompt: list[int], args: argparse.Namespace) -> tuple[float, int]:
    started = time.perf_counter()
    answers = await asyncio.gather(*(completion(client, prompt, args, 1, 1 + j) for j in range(N)))
    return time.perf_counter() - started, sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)


async def side_distinct(client: httpx.AsyncClient, prompt: list[int], args: argparse.Namespace) -> tuple[float, int]:
    """No sharing possible: four concurrent requests of four different prompts of that length."""
    prompts = [prompt] + [[(t + 11 * j) % 40000 + 200 for t in prompt] for j in range(1, N)]
    started = time.perf_counter()
    answers = await asyncio.gather(*(completion(client, p, args, 1, 1 + j) for j, p in enumerate(prompts)))
    return time.perf_counter() - started, sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)


SIDES = {
    "n=4": side_n,
    "4 sequential": side_sequential,
    "4 concurrent": side_concurrent,
    "4 concurrent, 4 prompts": side_distinct,
}


async def run(args: argparse.Namespace) -> dict:
    tokenizer = Tokenizer.from_dir(resolve_model(None))
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-n-bench-"))
    mesh = LocalMesh(MeshOptions(kv_cache_mib=256, num_threads=args.threads), workdir)
    await asyncio.to_thread(mesh.start, lambda m: logger.info("mesh: %s", m))
    times: dict[str, list[float]] = {name: [] for name in SIDES}
    extra: dict[str, list[int]] = {name: [] for name in SIDES}
    try:
        async with httpx.AsyncClient(base_url=mesh.base_url, timeout=300) as client:
            await completion(client, prompt_for(tokenizer, 10_000, args.prompt_tokens), args, N, 0)  # warm-up
            index = 0
            names = list(SIDES)
            for round_number in range(args.rounds):
                order = names[round_number % len(names) :] + names[: round_number % len(names)]
                for name in order:
                    index += 1
                    seconds, info = await SIDES[name](client, prompt_for(tokenizer, index, args.prompt_tokens), args)
                    times[name].append(seconds)
                    extra[name].append(info)
                    logger.info("round %d %s: %.2fs (%s)", round_number, name, seconds, info)
    finally:
        await asyncio.to_thread(mesh.stop)
    summary = {name: {"median_s": statistics.median(values), "all_s": values} for name, values in times.items()}
    for name in ("4 sequential", "4 concurrent", "4 concurrent, 4 prompts"):
        summary[name]["speedup_of_n4"] = summary[name]["median_s"] / summary["n=4"]["median_s"]
        summary[name]["cached_prompt_tokens"] = extra[name]
    summary["n=4"]["distinct_choices"] = extra["n=4"]
    return summary


def machine() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--json", type=Path, help="the numbers, the command and the machine as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = datetime.now(UTC)
    summary = asyncio.run(run(args))
    result = {
        "when": f"{started:%Y-%m-%d %H:%M} UTC",
        "command": " ".join(sys.argv),
        "machine": machine(),
        "load_average": os.getloadavg(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": summary,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
