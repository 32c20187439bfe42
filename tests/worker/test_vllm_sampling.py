"""kvmesh's sampling parameters as vLLM's (``VllmCore.sampling``), in a process of the vLLM
virtualenv, without a model: a prefill for export generates one token, so a request's
``min_tokens`` above 1 must be capped there (vLLM refuses ``min_tokens > max_tokens``; every
forced-length request failed at a vLLM prefill worker before), and the decode side counts
the token the export made."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvmesh.worker.engines import worker_python

pytestmark = pytest.mark.vllm

SHARED = Path(__file__).resolve().parents[2] / "shared"

SCRIPT = """
import json, types
from vllm.sampling_params import RequestOutputKind
from kvmesh.engine.request import SamplingParams
from kvmesh.worker.vllm_core import VllmCore

core = types.SimpleNamespace(_delta=RequestOutputKind.DELTA)
p = SamplingParams(max_tokens=16, min_tokens=16, ignore_eos=True)
export = VllmCore.sampling(core, p, max_tokens=1, transfer={"export": "r"})
imported = VllmCore.sampling(core, p, max_tokens=p.max_tokens - 1, generated=1)
plain = VllmCore.sampling(core, SamplingParams(max_tokens=8, min_tokens=3))
print(json.dumps({k: [s.max_tokens, s.min_tokens] for k, s in (("export", export), ("import", imported), ("plain", plain))}))
"""


def test_min_tokens_is_capped_for_the_one_token_of_an_export():
    try:
        python = worker_python("vllm")
    except ValueError as exc:
        pytest.skip(f"no vLLM virtualenv ({exc})")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SHARED), *filter(None, [env.get("PYTHONPATH")])])  # this tree's kvmesh
    done = subprocess.run([python, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"export": [1, 1], "import": [15, 15], "plain": [8, 3]}
