"""One vLLM process, the reference a mesh of vLLM workers is compared with: run by the
tests with ``.venv-vllm/bin/python`` (vLLM is not in the test's own virtualenv).

Reads ``{"model", "block_size", "requests": [{"prompt_token_ids", "max_tokens", "ignore_eos"}]}``
as JSON on stdin and prints ``{"outputs": [{"token_ids", "text", "finish_reason"}]}`` as the
last line of stdout: greedy, float32, ``LLM.generate`` on all the prompts at once.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    job = json.load(sys.stdin)
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job["model"], dtype="float32", block_size=job["block_size"], max_model_len=2048,
        kv_cache_memory_bytes=256 * 2**20, enforce_eager=True, seed=0,
    )  # fmt: skip
    requests = job["requests"]
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"]) for r in requests]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = [
        {"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text, "finish_reason": o.outputs[0].finish_reason}
        for o in outputs
    ]
    sys.stdout.write("\n" + json.dumps({"outputs": result}) + "\n")


if __name__ == "__main__":  # vLLM may spawn processes: never build an engine on import
    main()
