"""The cluster KV cache on the real mesh, each comparison side by side in one run.

1. The seed's multi-turn chat: N users x R rounds, ~100-token turns, 50 new tokens each, a
   shared system prompt; the mesh with prefix caching and KV-aware routing against the same
   mesh with prefix caching off and load-only routing. Throughput and TTFT p50/p99.
2. TTFT of a prefill whose 2,048-token prefix is cached on a peer prefill worker (pulled
   through Mooncake) against the same prompt length cold, and against a local cache hit,
   measured at the prefill workers (this script sends the NATS requests a router would).

    .venv/bin/python benchmarks/cluster_cache_bench.py --markdown docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from datetime import datetime, UTC
from pathlib import Path

import httpx
import nats

from kvmesh.engine.loader.default_model import resolve_model
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.infra.local_mesh import LocalMesh, MeshOptions
from kvmesh.protocol import STREAM_MESSAGE, PeerPrefix, PrefillRequest, PrefillResponse, ReleaseRequest, SamplingSpec, Subjects

logger = logging.getLogger("cluster_cache_bench")
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = (
    "You are a helpful travel assistant for a small agency. Answer in a friendly tone, suggest concrete "
    "places, keep each answer short, and ask one follow-up question when the request is vague. "
) * 2
TURNS = [
    "I want to visit a city with old architecture and good food in spring. Where should I go and why?",
    "That sounds good. What are three neighbourhoods worth walking through, and what is special about each?",
    "How many days would you plan there, and what would a relaxed itinerary look like for the first day?",
    "Which local dishes should I try, and are there markets where I can taste several of them at once?",
    "Finally, what is the best way to travel from the airport to the centre, and roughly how long does it take?",
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ----------------------------------------------------------------------------- multi-turn
async def user_session(client: httpx.AsyncClient, user: int, rounds: int, new_tokens: int, ttfts: list[float]) -> int:
    messages = [{"role": "system", "content": SYSTEM}]
    produced = 0
    for turn in range(rounds):
        messages.append({"role": "user", "content": f"(user {user}) " + TURNS[turn % len(TURNS)]})
        body = {"model": MODEL, "messages": messages, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        first = None
        text = []
        async with client.stream("POST", "/v1/chat/completions", json=body, headers={"x-session-id": f"user-{user}"}) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    produced += event["usage"]["completion_tokens"]
                for choice in event.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece and first is None:
                        first = time.perf_counter() - started
                    text.append(piece)
        ttfts.append(first if first is not None else time.perf_counter() - started)
        messages.append({"role": "assistant", "content": "".join(text)})
    return produced


async def multi_turn(args: argparse.Namespace, *, reuse: bool) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-mt-"))
    routing = None
    if not reuse:
        routing = workdir / "routing.json"
        routing.write_text(json.dumps({"plugins": [{"name": "load", "weight": 1}]}))
    options = MeshOptions(
        prefill=args.prefill, decode=1, kv_cache_mib=512, prefix_caching=reuse, dtype=args.dtype,
        routing_config=str(routing) if routing else None, kv_metadata=reuse,
    )
    mesh = LocalMesh(options, workdir)
    await asyncio.to_thread(mesh.start, lambda m: logger.info("mesh (%s): %s", "on" if reuse else "off", m))
    try:
        ttfts: list[float] = []
        async with httpx.AsyncClient(base_url=mesh.base_url, timeout=600) as client:
            started = time.perf_counter()
            produced = await asyncio.gather(*(user_session(client, u, args.rounds, args.new_tokens, ttfts) for u in range(args.users)))
            seconds = time.perf_counter() - started
    finally:
        await asyncio.to_thread(mesh.stop)
    result = {
        "output_tokens": sum(produced),
        "seconds": seconds,
        "throughput": sum(produced) / seconds,
        "ttft_p50_ms": percentile(ttfts, 0.5) * 1e3,
        "ttft_p99_ms": percentile(ttfts, 0.99) * 1e3,
    }
    logger.info("multi-turn %s: %s", "on" if reuse else "off", result)
    return result


# ----------------------------------------------------------------------------- peer pull
async def prefill_once(nc, subjects: Subjects, worker: str, rid: str, prompt: list[int], peer: PeerPrefix | None) -> tuple[float, PrefillResponse]:
    request = PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=SamplingSpec(max_tokens=1), peer=peer)
    reply = subjects.stream("bench", rid, "prefill")  # answered there, progress first, as to a router
    answers = await nc.subscribe(reply)
    started = time.perf_counter()
    await nc.publish(subjects.prefill(worker), request.encode(), reply=reply)
    while (message := STREAM_MESSAGE.validate_json((await answers.next_msg(timeout=300)).data)).kind != "prefill":
        pass
    seconds = time.perf_counter() - started
    await answers.unsubscribe()
    assert isinstance(message, PrefillResponse)
    if message.kv is not None:  # as a decode worker would, with the pin's token
        await nc.publish(subjects.release(worker), ReleaseRequest(request_id=rid, pin_token=message.kv.pin_token).encode())
    return seconds, message


async def peer_pull(args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-peer-"))
    mesh = LocalMesh(MeshOptions(prefill=2, decode=1, kv_cache_mib=512, dtype=args.dtype, num_threads=2), workdir)
    await asyncio.to_thread(mesh.start, lambda m: logger.info("mesh: %s", m))
    tokenizer = Tokenizer.from_dir(resolve_model(None))
    words = tokenizer.encode("The committee reviewed the harbour plans, the budget, the timetable and the old maps. " * 200)
    subjects = Subjects("default")
    results = {"cold": [], "peer": [], "local": []}
    try:
        nc = await nats.connect(mesh.nats.url)
        await prefill_once(nc, subjects, "prefill-2", "warm", words[:64], None)
        for i in range(args.peer_rounds):
            prefix = [(t + 7 * i) % 49000 + 100 for t in words[: args.prefix_tokens]]
            suffix = [(t + 13 * i) % 49000 + 100 for t in words[3000 : 3000 + 32]]
            # The prefix is computed on prefill-1 (the peer) ...
            await prefill_once(nc, subjects, "prefill-1", f"seed-{i}", prefix + suffix[:1], None)
            # ... then prefill-2 serves prefix + suffix, pulling the prefix from prefill-1.
            blocks = args.prefix_tokens // 16
            seconds, response = await prefill_once(
                nc, subjects, "prefill-2", f"peer-{i}", prefix + suffix, PeerPrefix(worker_id="prefill-1", num_blocks=blocks)
            )
            results["peer"].append(seconds)
            assert response.num_cached_tokens >= args.prefix_tokens - 16, response.num_cached_tokens
            # Local hit: the same prompt again on prefill-2 (now cached there).
            seconds, _ = await prefill_once(nc, subjects, "prefill-2", f"local-{i}", prefix + suffix, None)
            results["local"].append(seconds)
            # Cold: a prompt of the same length that nobody has seen.
            cold = [(t + 17 * i + 5) % 49000 + 100 for t in words[: args.prefix_tokens + 32]]
            seconds, response = await prefill_once(nc, subjects, "prefill-2", f"cold-{i}", cold, None)
            assert response.num_cached_tokens == 0
            results["cold"].append(seconds)
            logger.info("round %d: peer %.0f ms, local %.0f ms, cold %.0f ms", i, results["peer"][-1] * 1e3, results["local"][-1] * 1e3, seconds * 1e3)
        await nc.close()
    finally:
        await asyncio.to_thread(mesh.stop)
    return {side: statistics.median(values) * 1e3 for side, values in results.items()}


def markdown(args: argparse.Namespace, on: dict | None, off: dict | None, pull: dict | None) -> str:
    lines = [f"## Cluster KV cache on the real mesh ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)", "",
             f"Command: `{' '.join(sys.argv)}`  ", "Machine: AMD EPYC, 2 cores (the same machine as above), " + args.dtype, ""]
    if on and off:
        lines += [
            f"### Multi-turn chat: {args.users} users x {args.rounds} rounds, {args.new_tokens} new tokens, shared system prompt, "
            f"{args.prefill} prefill + 1 decode worker",
            "",
            "| metric | reuse off (no prefix cache, load-only routing) | reuse on (prefix cache, KV-aware routing) | ratio |",
            "|---|---:|---:|---:|",
            f"| output tokens/s | {off['throughput']:.1f} | {on['throughput']:.1f} | {on['throughput'] / off['throughput']:.2f}x |",
            f"| TTFT p50 (ms) | {off['ttft_p50_ms']:.0f} | {on['ttft_p50_ms']:.0f} | {off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x lower |",
            f"| TTFT p99 (ms) | {off['ttft_p99_ms']:.0f} | {on['ttft_p99_ms']:.0f} | {off['ttft_p99_ms'] / on['ttft_p99_ms']:.2f}x lower |",
            f"| wall time (s) | {off['seconds']:.1f} | {on['seconds']:.1f} | |",
        ]
    if pull:
        lines += [
            "",
            f"### Prefill TTFT with a {args.prefix_tokens}-token prefix cached on a peer (median of {args.peer_rounds})",
            "",
            "| case | TTFT at the prefill worker (ms) | vs cold |",
            "|---|---:|---:|",
            f"| cold (nothing cached) | {pull['cold']:.0f} | 1.00x |",
            f"| prefix pulled from the peer through Mooncake | {pull['peer']:.0f} | {pull['cold'] / pull['peer']:.2f}x lower |",
            f"| prefix cached locally | {pull['local']:.0f} | {pull['cold'] / pull['local']:.2f}x lower |",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=50)
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--peer-rounds", type=int, default=3)
    parser.add_argument("--skip-multi-turn", action="store_true")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    on = off = pull = None
    if not args.skip_multi_turn:
        off = asyncio.run(multi_turn(args, reuse=False))
        on = asyncio.run(multi_turn(args, reuse=True))
    if not args.skip_peer:
        pull = asyncio.run(peer_pull(args))
    report = markdown(args, on, off, pull)
    print(report)
    if args.out:
        args.out.write_text(json.dumps({"multi_turn": {"on": on, "off": off}, "peer_pull_ms": pull}, indent=2))
    if args.markdown:
        with args.markdown.open("a") as handle:
            handle.write("\n" + report)


if __name__ == "__main__":
    main()
