"""The ``kvmesh`` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import uuid
from pathlib import Path
from typing import Any

from kvmesh import __version__
from kvmesh.machine import DTYPE_CHOICES
from kvmesh.settings import env
from kvmesh.settings.values import host_address, integer, non_negative_int, non_negative_number, port_number, number, positive_int, positive_number
from kvmesh.worker.engines import ENGINES

logger = logging.getLogger("kvmesh")


class _Parser(argparse.ArgumentParser):
    """Argument errors on one line (``kvmesh up: error: ...``), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, where it has one the help does not already tell."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or not text:
            return action.help
        return super()._get_help_string(action)


class _NoKeyInArgv(argparse.Action):
    """``--api-key`` is refused: a key in argv is visible to every user of the machine (ps)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        parser.error("--api-key is gone (ps shows argv to everyone): use --api-key-file PATH or the environment variable KVMESH_API_KEY")


def _token_bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be TOKEN=BIAS (a token id and a number), got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvmesh", description="LLM serving with a cluster-wide KV cache", formatter_class=_Help)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"kvmesh {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text in this process (a quick look at the engine)")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--system", help="system message (with --chat)")
    gen.add_argument("--model", help="model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--max-tokens", type=positive_int, default=128)
    gen.add_argument("--temperature", type=non_negative_number, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=number, default=1.0)
    gen.add_argument("--top-k", type=non_negative_int, default=0)
    gen.add_argument("--seed", type=integer)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--presence-penalty", type=number, default=0.0, help="OpenAI's, over the generated tokens")
    gen.add_argument("--frequency-penalty", type=number, default=0.0, help="OpenAI's, over the generated tokens")
    gen.add_argument("--repetition-penalty", type=positive_number, default=1.0, help="over prompt and generated tokens (1: off)")
    gen.add_argument("--min-p", type=number, default=0.0)
    gen.add_argument("--min-tokens", type=non_negative_int, default=0, help="no EOS or stop string before this many tokens")
    gen.add_argument("--logit-bias", type=_token_bias, action="append", default=[], metavar="TOKEN=BIAS",
                     help="add BIAS to token id TOKEN's logit (repeatable)")
    gen.add_argument(
        "--dtype", choices=DTYPE_CHOICES, default=env.DTYPE.raw() or "auto",
        help="auto: bfloat16 where the CPU (or, with --device cuda, the GPU) has native bf16, else float32 (KVMESH_DTYPE)",
    )  # fmt: skip
    gen.add_argument("--device", default="cpu", help="cpu, cuda or npu")
    gen.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": "..."}')

    up = commands.add_parser(
        "up", help="run the whole mesh on this machine: nats, etcd, router, workers", formatter_class=_Help,
        description="Run the whole mesh on this machine: nats-server, etcd, kv-metadata, the router and the workers. "
        "The router's and the workers' options are forwarded to them; one not given is left to the service "
        "(and to its KVMESH_* environment variable).",
    )  # fmt: skip
    up.add_argument("--version", action="version", version=f"kvmesh {__version__}")
    up.add_argument(
        "--prefill", type=non_negative_int, default=1,
        help="prefill workers (0: decode workers prefill themselves)",
    )  # fmt: skip
    up.add_argument("--decode", type=positive_int, default=1, help="decode workers")
    up.add_argument("--host", type=host_address, default="127.0.0.1", help="the router's address")
    up.add_argument("--port", type=port_number, default=8000, help="the router's port (0 picks a free one)")
    up.add_argument("--model", help="model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    up.add_argument("--engine", choices=ENGINES, default="kvmesh", help="what the workers run: kvmesh (its own engine) or vllm (`make vllm`; workers run with .venv-vllm/bin/python)")
    up.add_argument(
        "--dtype", choices=DTYPE_CHOICES, default=env.DTYPE.raw() or "auto",
        help="the workers' weights and KV cache; auto: bfloat16 where the CPU has native bf16 (AVX512-BF16, AMX-BF16) "
        "or, with --device cuda, the GPU (compute capability 8.0 on), else float32 (KVMESH_DTYPE)",
    )  # fmt: skip
    up.add_argument("--kv-cache-mib", type=positive_int, default=256, help="KV pool per worker")
    up.add_argument("--block-size", type=positive_int, help="tokens per KV block (default: 16; 32 with vllm)")
    up.add_argument("--num-threads", type=positive_int, help="threads per worker (default: the cores split between the workers)")
    up.add_argument("--no-prefix-caching", action="store_true", help="workers do not reuse KV blocks")
    up.add_argument(
        "--lend-cores", action=argparse.BooleanOptionalAction, default=None,
        help="on the CPU: a worker runs on every core while the other workers are idle, else on its share "
        "(default: on where the workers split the cores; --no-lend-cores keeps each to its share)",
    )  # fmt: skip
    up.add_argument("--routing-config", help="JSON or YAML file of the router's scoring plugins and weights (default: prefix x2, load x1, session x1)")
    up.add_argument("--lease-ttl", type=positive_int, default=5, help="seconds a worker's etcd lease outlives it")
    up.add_argument("--pin-ttl", type=positive_int, default=30, help="seconds a prefill worker holds KV blocks for a decode worker at most")
    up.add_argument("--request-timeout", type=positive_number, default=30.0, help="seconds for any single network wait of a service")
    up.add_argument("--api-key", nargs="?", action=_NoKeyInArgv, help=argparse.SUPPRESS)
    up.add_argument(
        "--api-key-file",
        help="require a Bearer token on /v1: a file of keys, one a line as name:key (a bare key is named default); "
        "KVMESH_API_KEY in the environment adds one key named default",
    )
    up.add_argument(
        "--tls", action=argparse.BooleanOptionalAction, default=True,
        help="NATS and etcd over TLS only, with a fresh CA in <workdir>/tls (default: on; --no-tls: plaintext on loopback)",
    )
    up.add_argument("--workdir", help="logs, server data, the mesh's credentials and its CA (default: a new temporary folder, removed at the end; its logs kept after a failure)")
    from kvmesh.infra.up import add_service_args

    add_service_args(up)

    creds = commands.add_parser(
        "credentials", help="make the secrets of a deployment (deploy/compose, deploy/k8s): CA, certificates, users, passwords"
    )
    creds.add_argument("--out", required=True, help="folder to write them to (mode 0700), e.g. deploy/compose/secrets")
    creds.add_argument(
        "--prefill", type=non_negative_int, default=4,
        help="prefill identities, prefill-worker-0 ...: the most prefill workers (compose replicas, StatefulSet pods) at once",
    )  # fmt: skip
    creds.add_argument(
        "--decode", type=positive_int, default=4,
        help="decode identities, decode-worker-0 ...: the most decode workers (compose replicas, StatefulSet pods) at once",
    )  # fmt: skip
    creds.add_argument("--namespace", default="default", help="the mesh's namespace (KVMESH_NAMESPACE)")
    creds.add_argument("--k8s-namespace", default="kvmesh", help="the Kubernetes namespace of the Secrets and services")
    creds.add_argument(
        "--request-deadline", type=positive_number, default=1800.0,
        help="the services' KVMESH_REQUEST_DEADLINE: how long a worker may answer one piece of work (plus 60 s)",
    )  # fmt: skip

    etcd_auth = commands.add_parser("etcd-auth", help="turn etcd's auth on with a deployment's users (the compose / k8s job)")
    etcd_auth.add_argument("--users", default=env.ETCD_USERS.raw(), help="etcd-users.json (KVMESH_ETCD_USERS)")
    etcd_auth.add_argument("--etcd", default=env.ETCD_ENDPOINTS.raw(), help="host:port (KVMESH_ETCD_ENDPOINTS)")
    etcd_auth.add_argument("--etcd-tls-ca", default=env.ETCD_TLS_CA.raw(), help="CA file (KVMESH_ETCD_TLS_CA)")
    etcd_auth.add_argument("--wait", type=non_negative_number, default=60.0, help="seconds to wait for etcd to answer")

    replay = commands.add_parser("replay", help="replay a Mooncake-format trace (--simulate: simulated prefill workers, no model)")
    replay.add_argument("--trace", required=True, help="JSONL trace: timestamp (ms), input_length, output_length, hash_ids")
    replay.add_argument("--simulate", action="store_true", help="simulate prefill workers under each routing policy")
    replay.add_argument("--workers", type=positive_int, default=16, help="simulated prefill workers")
    replay.add_argument("--cache-blocks", type=positive_int, default=6000, help="LRU cache per worker, in blocks")
    replay.add_argument("--prefill-rate", type=positive_number, default=2500.0, help="prompt tokens/s per worker")
    replay.add_argument("--pull-ms", type=non_negative_number, default=6.7, help="ms to pull one block from a peer")
    replay.add_argument("--policies", default="random,round-robin,least-load,prefix-only,kv-aware",
                        help="comma-separated: random, round-robin, least-load, prefix-only, kv-aware, kv-aware-local, weighted")
    replay.add_argument("--scorer-config", help="JSON/YAML plugin weights for the weighted policy (default: the built-in config)")
    replay.add_argument("--time-scale", type=positive_number, default=1.0, help="multiplies the timestamps (2: half the load)")
    replay.add_argument("--block-size", type=positive_int, default=512, help="tokens per hash_id")
    replay.add_argument("--seed", type=integer, default=0, help="seed of the random policy")
    replay.add_argument("--json", action="store_true", help="print the figures as JSON")
    mesh = replay.add_argument_group("replaying against a running mesh (without --simulate)")
    mesh.add_argument("--url", help="the router's base URL, e.g. http://127.0.0.1:8000")
    mesh.add_argument("--model", default="SmolLM2-135M-Instruct", help="the served model name")
    mesh.add_argument("--tokens-per-block", type=positive_int, default=16, help="tokens each trace block becomes (a multiple of 16)")
    mesh.add_argument("--max-blocks", type=positive_int, default=32, help="prompts are capped at this many trace blocks")
    mesh.add_argument("--max-output-tokens", type=positive_int, default=16)
    mesh.add_argument("--max-requests", type=positive_int, default=50)
    return parser


def _up(args: argparse.Namespace) -> int:
    from kvmesh.infra.up import run_up

    return run_up(args)


def _generate(args: argparse.Namespace) -> int:
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams
    from kvmesh.engine.tokenizer import ChatTemplateError

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        min_p=args.min_p,
        min_tokens=args.min_tokens,
        logit_bias=dict(args.logit_bias),
    )
    if not args.prompt and not args.chat:  # said before the model loads
        raise SystemExit("kvmesh generate: error: the prompt is empty")
    logger.info("loading the model")
    # no warm-up of the grammar compiler: generate has no structured output, and the warm-up
    # would take a core for a second of a short run
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, kv_cache_bytes=256 * 2**20, warm_grammar=False)
    engine = LLMEngine(config)
    tokenizer = engine.tokenizer
    text = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ChatTemplateError as exc:
            raise SystemExit(f"kvmesh generate: error: {exc}") from None
    prompt_ids = tokenizer.encode(text, add_special_tokens=not args.chat)
    if not prompt_ids:
        raise SystemExit("kvmesh generate: error: the prompt is empty")
    request_id = uuid.uuid4().hex
    engine.add_request(request_id, prompt_ids, params)
    token_ids: list[int] = []
    pieces: list[str] = []
    while engine.has_unfinished():
        for out in engine.step():
            token_ids.extend(out.new_token_ids)
            pieces.append(out.text)
            if not args.json:
                sys.stdout.write(out.text)
                sys.stdout.flush()
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": "".join(pieces)}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    return 0


def _replay_mesh(args: argparse.Namespace) -> int:
    import asyncio

    from kvmesh.replay import load_trace
    from kvmesh.replay.driver import DriveConfig, drive

    if not args.url:
        raise SystemExit("kvmesh replay: error: give --url of a running mesh (see `kvmesh up`), or --simulate")
    if args.tokens_per_block % 16:
        raise SystemExit("kvmesh replay: error: --tokens-per-block must be a multiple of 16 (the KV block size)")
    trace = load_trace(args.trace, time_scale=args.time_scale, block_size=args.block_size)
    config = DriveConfig(
        base_url=args.url.rstrip("/").removesuffix("/v1"),
        model=args.model,
        tokens_per_block=args.tokens_per_block,
        max_blocks=args.max_blocks,
        max_output_tokens=args.max_output_tokens,
        max_requests=args.max_requests,
    )
    result = asyncio.run(drive(trace, config)).to_dict()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{result['requests']} requests ({result['failed']} failed) in {result['seconds']:.1f} s: "
            f"{result['output_tokens_per_s']:.1f} output tokens/s; TTFT p50 {result['ttft_p50_ms']:.0f} ms, "
            f"p90 {result['ttft_p90_ms']:.0f} ms; cache hits {100 * result['hit_rate']:.1f} % of prompt tokens "
            f"(oracle {100 * result['oracle_hit_rate']:.1f} %)"
        )
    return 0 if result["failed"] == 0 else 1


def _replay(args: argparse.Namespace) -> int:
    import time

    from kvmesh.replay import SimConfig, load_trace, oracle_hits, simulate_policies
    from kvmesh.routing import load_scorer_config, read_scorer_config

    if not args.simulate:
        return _replay_mesh(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise SystemExit("kvmesh replay: error: --policies names no policy")
    scorer_config = None
    if args.scorer_config:
        scorer_config = read_scorer_config(args.scorer_config)
        load_scorer_config(scorer_config)  # fail now, not after the other policies ran
    config = SimConfig(
        workers=args.workers,
        cache_blocks=args.cache_blocks,
        prefill_rate=args.prefill_rate,
        pull_seconds=args.pull_ms / 1000.0,
        block_size=args.block_size,
        seed=args.seed,
        scorer_config=scorer_config,
    )
    trace = load_trace(args.trace, time_scale=args.time_scale, block_size=args.block_size)
    began = time.perf_counter()
    results = simulate_policies(trace, config, policies)
    elapsed = time.perf_counter() - began
    blocks = sum(len(r.hash_ids) for r in trace)
    summary: dict[str, Any] = {
        "trace": {
            "path": str(args.trace),
            "requests": len(trace),
            "blocks": blocks,
            "input_tokens": sum(r.input_length for r in trace),
            "duration_s": trace[-1].arrival - trace[0].arrival,
            "oracle_hit_rate": oracle_hits(trace) / blocks,
        },
        "config": {
            "workers": args.workers,
            "cache_blocks": args.cache_blocks,
            "prefill_rate": args.prefill_rate,
            "pull_ms": args.pull_ms,
            "time_scale": args.time_scale,
            "block_size": args.block_size,
            "seed": args.seed,
        },
        "policies": {r.policy: r.to_dict() for r in results},
        "simulation_s": elapsed,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    t = summary["trace"]
    print(
        f"{t['requests']} requests, {t['blocks']} blocks over {t['duration_s']:.0f} s; oracle hit rate {t['oracle_hit_rate']:.1%}\n"
        f"{args.workers} workers x {args.cache_blocks} blocks, {args.prefill_rate:g} tokens/s, {args.pull_ms:g} ms/pulled block, "
        f"time scale {args.time_scale:g}  (simulated in {elapsed:.1f} s)\n"
    )
    header = f"{'policy':<15} {'hit rate':>8} {'% oracle':>8} {'pulled':>7} {'TTFT mean':>10} {'p50':>8} {'p90':>8} {'p99':>8} {'max util':>8} {'imbal.':>6}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.policy:<15} {r.hit_rate:>8.1%} {r.hit_pct_of_oracle:>7.1f}% {r.pulled_blocks:>7} {r.ttft_mean:>9.2f}s "
            f"{r.ttft_p50:>7.2f}s {r.ttft_p90:>7.2f}s {r.ttft_p99:>7.2f}s {r.max_utilization:>8.1%} {r.imbalance:>6.2f}"
        )
    return 0


def _credentials(args: argparse.Namespace) -> int:
    from kvmesh.infra.deploy_secrets import generate

    out = Path(args.out).expanduser()
    try:
        secrets = generate(
            out, prefill=args.prefill, decode=args.decode, mesh_namespace=args.namespace, k8s_namespace=args.k8s_namespace,
            request_deadline=args.request_deadline,
        )  # fmt: skip
    except OSError as exc:
        raise SystemExit(f"kvmesh credentials: error: --out {out}: {exc.strerror or exc}") from None
    print(f"wrote the secrets of {len(secrets)} Kubernetes Secrets to {out} (see {out / 'README'})")
    return 0


def _etcd_auth(args: argparse.Namespace) -> int:
    from kvmesh.infra import etcd_auth

    if not args.users or not args.etcd:
        raise SystemExit("kvmesh etcd-auth: error: --users and --etcd (or KVMESH_ETCD_USERS, KVMESH_ETCD_ENDPOINTS) are required")
    etcd_auth.run(args.etcd.split(","), Path(args.users), tls_ca=args.etcd_tls_ca, wait=args.wait)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "dtype", "auto") not in DTYPE_CHOICES:  # KVMESH_DTYPE's: argparse checks only what it parsed
        sys.stderr.write(f"kvmesh {args.command}: error: KVMESH_DTYPE={args.dtype!r}: not one of {', '.join(DTYPE_CHOICES)}\n")
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from kvmesh.errors import KvmeshError
    from kvmesh.infra.up import UpUsageError

    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "up":
            return _up(args)
        if args.command == "replay":
            return _replay(args)
        if args.command == "credentials":
            return _credentials(args)
        if args.command == "etcd-auth":
            return _etcd_auth(args)
    except UpUsageError as exc:
        sys.stderr.write(f"kvmesh {args.command}: error: {exc}\n")
        return 2
    except (KvmeshError, ValueError) as exc:
        raise SystemExit(f"kvmesh {args.command}: error: {exc}") from None
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
