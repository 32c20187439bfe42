"""One vLLM process, the reference a mesh of vLLM workers is compared with: run by the
tests with ``.venv-vllm/bin/python`` (vLLM is not in the test's own virtualenv).

Reads ``{"model", "block_size", "requests": [{"prompt_token_ids", "max_tokens", "ignore_eos"}]}``
(and optionally ``tensor_parallel_size``) as JSON on stdin and prints ``{"outputs": [{"token_ids", "text", "finish_reason"}]}`` as the
last line of stdout: greedy, float32, ``LLM.generate`` on all the prompts at once. A request
may also name ``logprobs``, ``prompt_logprobs`` (its output then has them as vLLM gave them:
per position ``[[token id, logprob, rank], ...]`` in vLLM's order, the prompt's first None),
``structured_outputs`` (``StructuredOutputsParams``' arguments; the guidance backend, as
kvmesh's workers use) and ``group``: the groups are generated one after the other, in order.
A request with ``after`` (the index of one in an earlier group) and ``then`` (token ids) has
for its prompt that one's prompt, its output's tokens and ``then`` (a conversation's next
turn); its output names its ``prompt_token_ids``.
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
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(
        model=job["model"], dtype="float32", block_size=job["block_size"], max_model_len=2048,
        kv_cache_memory_bytes=256 * 2**20, enforce_eager=True, seed=0, structured_outputs_config={"backend": "guidance"},
        tensor_parallel_size=job.get("tensor_parallel_size", 1),
    )  # fmt: skip
    requests = job["requests"]
    result: list = [None] * len(requests)
    for group in sorted({r.get("group", 0) for r in requests}):
        todo = [i for i, r in enumerate(requests) if r.get("group", 0) == group]
        for i in todo:
            if "after" in requests[i]:
                before = requests[requests[i]["after"]]
                requests[i]["prompt_token_ids"] = before["prompt_token_ids"] + result[requests[i]["after"]]["token_ids"] + requests[i]["then"]
        prompts = [TokensPrompt(prompt_token_ids=requests[i]["prompt_token_ids"]) for i in todo]
        params = [_params(requests[i], SamplingParams, StructuredOutputsParams) for i in todo]
        for i, o in zip(todo, llm.generate(prompts, params, use_tqdm=False)):
            c = o.outputs[0]
            result[i] = {"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason}
            if "after" in requests[i]:
                result[i]["prompt_token_ids"] = requests[i]["prompt_token_ids"]
            if c.logprobs is not None:
                result[i]["logprobs"] = [_position(p) for p in c.logprobs]
            if o.prompt_logprobs is not None:
                result[i]["prompt_logprobs"] = [_position(p) for p in o.prompt_logprobs]
    sys.stdout.write("\n" + json.dumps({"outputs": result}) + "\n")


def _params(r: dict, sampling_params, structured_outputs_params):
    structured = r.get("structured_outputs")
    return sampling_params(
        temperature=0, max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"], logprobs=r.get("logprobs"),
        prompt_logprobs=r.get("prompt_logprobs"),
        structured_outputs=structured_outputs_params(**structured) if structured is not None else None,
    )  # fmt: skip


def _position(entry) -> list | None:
    return None if entry is None else [[int(t), float(v.logprob), v.rank] for t, v in entry.items()]


if __name__ == "__main__":  # vLLM may spawn processes: never build an engine on import
    main()
