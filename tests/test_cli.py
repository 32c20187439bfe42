"""The ``kvmesh`` command, run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def kvmesh(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_generate_json_on_a_model_dir(tiny_model_dir):
    done = kvmesh("generate", "--model", str(tiny_model_dir), "--prompt", "The river", "--max-tokens", "6", "--ignore-eos", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert len(result["token_ids"]) == 6 and isinstance(result["text"], str)
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64))
    [want] = engine.generate([engine.tokenizer.encode("The river")], SamplingParams(max_tokens=6, ignore_eos=True))
    assert result == {"token_ids": want.new_token_ids, "text": want.text}


def test_generate_with_sampling_options(tiny_model_dir):
    options = ["--repetition-penalty", "1.5", "--frequency-penalty", "0.5", "--logit-bias", "11=3", "--min-tokens", "2"]
    done = kvmesh("generate", "--model", str(tiny_model_dir), "--prompt", "The river", "--max-tokens", "8", "--json", *options)
    assert done.returncode == 0, done.stderr
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64))
    params = SamplingParams(max_tokens=8, repetition_penalty=1.5, frequency_penalty=0.5, logit_bias={11: 3.0}, min_tokens=2)
    [want] = engine.generate([engine.tokenizer.encode("The river")], params)
    assert json.loads(done.stdout) == {"token_ids": want.new_token_ids, "text": want.text}


@pytest.mark.slow
def test_default_model_chat_answers_paris(default_model_dir):
    cache = default_model_dir.parent.parent  # resolve_model's cache root
    done = kvmesh(
        "generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "32", "--json",
        env={"KVMESH_CACHE_DIR": str(cache)},
    )
    assert done.returncode == 0, done.stderr
    assert "Paris" in json.loads(done.stdout)["text"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-tokens", "0"], "--max-tokens: must be a positive integer"),
        (["--temperature", "-1"], "--temperature: must be 0 or more"),
        (["--temperature", "nan"], "--temperature: must be a finite number"),  # was taken
        (["--seed", str(2**64)], f"seed must be in [{-(2**63)}, {2**64 - 1}]"),  # was a traceback after the model loaded
        (["--top-p", "2"], "top_p must be in (0, 1]"),
        (["--model", "/nonexistent/model"], "unknown model"),
        (["--logit-bias", "5"], "must be TOKEN=BIAS"),
        (["--presence-penalty", "3"], "presence_penalty must be in [-2, 2]"),
    ],
)
def test_bad_input_gets_a_clear_message(args, message):
    done = kvmesh("generate", "--prompt", "hi", *args)
    assert done.returncode != 0
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def start_up(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """``kvmesh up`` (32 MiB of KV a worker) and its base URL, once it says it is serving."""
    import re

    up = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", "up", "--port", "0", "--kv-cache-mib", "32", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    line = up.stdout.readline()  # printed once everything is ready
    match = re.search(r"serving at (http://\S+)/v1", line)
    if match is None:
        up.kill()
        raise AssertionError((line, up.communicate()[1]))
    return up, match.group(1)


@pytest.mark.slow
def test_kvmesh_up_serves_and_stops_on_ctrl_c(default_model_dir, tmp_path):
    import signal
    import urllib.request

    up, base = start_up(["--workdir", str(tmp_path)], {"KVMESH_CACHE_DIR": str(default_model_dir.parent.parent)})
    try:
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0})
        request = urllib.request.Request(f"{base}/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["choices"][0]["text"].startswith(" Paris")
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        stderr = up.stderr.read()
        assert "kvmesh up: stopped" in stderr
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{base}/health", timeout=2)
        logs = {p.name for p in (tmp_path / "logs").iterdir()}
        assert {"router.log", "prefill-1.log", "decode-2.log", "nats-server.log"} <= logs
    finally:
        if up.poll() is None:
            up.kill()


@pytest.mark.slow
def test_kvmesh_up_without_a_workdir_leaves_nothing_behind(default_model_dir, tmp_path):
    """Its temporary workdir (the mesh's credentials, its CA's key, etcd's data, the logs) goes
    when it stops; a health port set in the environment, which would be every service's,
    is said to be ignored rather than failing the second service to bind it; so are a
    worker's lending board slot and bound cores (one worker's each: the worker would open a
    board that is not there)."""
    import signal

    from kvmesh.infra.processes import free_port

    env = {
        "KVMESH_CACHE_DIR": str(default_model_dir.parent.parent), "TMPDIR": str(tmp_path), "KVMESH_HEALTH_PORT": str(free_port()),
        "KVMESH_LEND_CORES": str(tmp_path / "no-board:0"), "KVMESH_CPU_BIND": "0",
    }  # fmt: skip
    up, _ = start_up(["--prefill", "0"], env)
    try:
        [workdir] = tmp_path.glob("kvmesh-up-*")
        assert (workdir / "logs" / "decode-1.log").exists() and (workdir / "pids.json").exists()
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        stderr = up.stderr.read()
        for name in ("KVMESH_HEALTH_PORT", "KVMESH_LEND_CORES", "KVMESH_CPU_BIND"):
            assert f"kvmesh up: {name} ignored: it names one process, and kvmesh up runs several" in stderr
        assert stderr.endswith("kvmesh up: stopped\n"), stderr
        assert list(tmp_path.glob("kvmesh-up-*")) == []  # (the workers' Mooncake start lock is shared, and stays)
    finally:
        if up.poll() is None:
            up.kill()


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["credentials", "--out", "/proc/self/no/such"], "kvmesh credentials: error: --out /proc/self/no/such: No such file or directory"),
        (["etcd-auth", "--users", "{binary}", "--etcd", "127.0.0.1:1"], "kvmesh etcd-auth: error: etcd users file {binary}: not UTF-8 text (byte 0 is 0xff)"),
        (["etcd-auth", "--users", "/no/such", "--etcd", "127.0.0.1:1"], "kvmesh etcd-auth: error: etcd users file /no/such: No such file or directory"),
        (["generate", "--prompt", ""], "kvmesh generate: error: the prompt is empty"),  # now before the model loads
    ],
)
def test_the_other_commands_say_a_bad_argument_in_one_line(tmp_path, args, error):
    binary = tmp_path / "users.json"
    binary.write_bytes(b"\xff{}")
    done = kvmesh(*(arg.replace("{binary}", str(binary)) for arg in args), env={"KVMESH_CACHE_DIR": str(tmp_path / "no-model")})
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert done.stderr.splitlines() == [error.replace("{binary}", str(binary))]  # no traceback, no model loading line


def test_up_refused_leaves_no_temporary_workdir(tmp_path):
    binary = tmp_path / "keys"
    binary.write_bytes(b"\xffkey")
    done = kvmesh("up", "--port", "0", "--api-key-file", str(binary), env={"TMPDIR": str(tmp_path / "tmp")})
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"kvmesh up: error: --api-key-file: cannot read the API key file {binary}: not UTF-8 text (byte 0 is 0xff)\n"
    (tmp_path / "tmp").mkdir(exist_ok=True)
    assert list((tmp_path / "tmp").iterdir()) == []  # it was made before the later checks refused


def test_up_on_a_busy_port_fails_at_once_on_one_line(tmp_path):
    """Before anything starts (no model load, no servers), not as a traceback later."""
    import socket
    import time

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        began = time.monotonic()
        done = kvmesh("up", "--port", str(port), "--workdir", str(tmp_path / "w"))
        took = time.monotonic() - began
    assert (done.returncode, done.stderr, done.stdout) == (2, f"kvmesh up: error: port {port} on 127.0.0.1 is in use\n", "")
    assert took < 5.0, took  # a guard against a wait; "at once" is the missing logs folder below
    assert not (tmp_path / "w" / "logs").exists()  # nothing was started


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model"], "kvmesh up: error: model path /nonexistent/model does not exist"),
        (["--model", "{empty_dir}"], "kvmesh up: error: model directory {empty_dir} has no config.json"),
        (["--port", "70000"], "kvmesh up: error: argument --port: must be a port number in 0..65535, got '70000'"),
        (["--prefill", "-1"], "kvmesh up: error: argument --prefill: must be 0 or more, got '-1'"),
        (["--decode", "0"], "kvmesh up: error: argument --decode: must be a positive integer, got '0'"),
        (["--dtype", "float64"], "kvmesh up: error: argument --dtype: invalid choice: 'float64'"),
        (["--engine", "vllm"], "kvmesh up: error: --engine vllm: "),
        (["--engine", "sglang"], "kvmesh up: error: argument --engine: invalid choice: 'sglang'"),
        (["--host", "no-such-host.invalid"], "kvmesh up: error: --host no-such-host.invalid:"),
        (["--no-such-flag"], "kvmesh: error: unrecognized arguments: --no-such-flag"),
        (["--port", "abc"], "kvmesh up: error: argument --port: must be an integer, got 'abc'"),
        (["--kv-cache-mib", "1e12"], "kvmesh up: error: argument --kv-cache-mib: must be an integer, got '1e12'"),
        # a model its worker would refuse only after the servers had started
        (["--model", "{tmp}/badjson"], "kvmesh up: error: --model {tmp}/badjson: {tmp}/badjson/config.json cannot be read as JSON"),
        (["--model", "{tmp}/keyless"], "kvmesh up: error: --model {tmp}/keyless: config.json has no 'num_attention_heads'"),
        (["--model", "/tmp/" + "a" * 300], "kvmesh up: error: --model /tmp/aaaa"),  # too long a name: no traceback
        (["--workdir", "/proc/self"], "kvmesh up: error: --workdir /proc/self: not writable"),
        (["--host", "bad host!"], "kvmesh up: error: argument --host: must be an IP address or a host name, got 'bad host!'"),
        # vLLM refused it only once its worker had loaded the model
        (["--engine", "vllm", "--block-size", "48"], "kvmesh up: error: --block-size 48: vLLM on CPU takes a multiple of 32"),
        # tensor parallel: vLLM's workers only, bound to their cores
        (["--tensor-parallel-size", "2"], "kvmesh up: error: --tensor-parallel-size 2: vLLM's workers only (--engine vllm)"),
        (
            ["--engine", "vllm", "--tensor-parallel-size", "2", "--device", "cuda"],
            "kvmesh up: error: --tensor-parallel-size 2 on cuda: kvmesh shares vLLM's ranks' KV pools on the CPU only yet",
        ),
        (
            ["--engine", "vllm", "--tensor-parallel-size", "2", "--lend-cores"],
            "kvmesh up: error: --tensor-parallel-size 2: its processes are bound to their cores; not with --lend-cores",
        ),
        (["--engine", "vllm", "--engine-args", '{"pipeline_parallel_size": 2}'], "kvmesh up: error: pipeline parallel: not run"),
        (["--engine", "vllm", "--engine-args", "[1]"], "kvmesh up: error: --engine-args: must be a JSON object of EngineArgs fields"),
    ],
)
def test_up_bad_arguments_fail_at_once_on_one_line(tmp_path, args, message):
    import time

    (tmp_path / "empty").mkdir()
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "config.json").write_text("{not json")
    (tmp_path / "keyless").mkdir()
    (tmp_path / "keyless" / "config.json").write_text('{"model_type": "llama"}')
    args = [a.replace("{empty_dir}", str(tmp_path / "empty")).replace("{tmp}", str(tmp_path)) for a in args]
    message = message.replace("{tmp}", str(tmp_path))
    began = time.monotonic()
    # --engine vllm: no Python with vLLM for the workers, even where the repository has a .venv-vllm
    done = kvmesh("up", "--port", "0", "--workdir", str(tmp_path / "w"), *args, env={"KVMESH_VLLM_PYTHON": "/nonexistent/python"})
    took = time.monotonic() - began
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(message.replace("{empty_dir}", str(tmp_path / "empty"))), done.stderr
    assert done.stderr.count("\n") == 1 and done.stdout == ""
    # "at once" is that nothing started (no logs folder); the time only guards against a wait
    # (1 s was too tight for a loaded 2-core machine: 1.006 s in one CI run, the process start alone)
    assert took < 5.0, took
    assert not (tmp_path / "w" / "logs").exists()


@pytest.mark.parametrize(
    "variables, message",
    [
        ({"KVMESH_TENSOR_PARALLEL_SIZE": "2"}, "kvmesh up: error: --tensor-parallel-size 2: its processes are bound to their cores; "),
        ({"KVMESH_ENGINE_ARGS": '{"tensor_parallel_size": 2}'}, "kvmesh up: error: --tensor-parallel-size 2: its processes are bound to their cores; "),
        ({"KVMESH_TENSOR_PARALLEL_SIZE": "two"}, "kvmesh up: error: KVMESH_TENSOR_PARALLEL_SIZE='two': "),
        # as the worker says it (0 was taken as 1 here, and refused by the worker only after the servers had started)
        ({"KVMESH_TENSOR_PARALLEL_SIZE": "0"}, "kvmesh up: error: KVMESH_TENSOR_PARALLEL_SIZE='0': must be a positive integer, got '0'"),
        ({"KVMESH_ENGINE_ARGS": "[1]"}, "kvmesh up: error: --engine-args: must be a JSON object of EngineArgs fields"),  # was a traceback
    ],
)
def test_up_judges_the_workers_parallel_variables_before_it_starts_anything(tmp_path, variables, message):
    """The workers inherit ``kvmesh up``'s environment: a tensor parallel size there is
    judged as a flag would be (here with cores lent, which tensor parallel refuses), before anything starts."""
    done = kvmesh(
        "up", "--port", "0", "--workdir", str(tmp_path / "w"), "--engine", "vllm", "--lend-cores",
        env={**variables, "KVMESH_VLLM_PYTHON": "/nonexistent/python"},
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "w" / "logs").exists()


@pytest.mark.slow
def test_up_says_a_workers_refusal_in_one_line(default_model_dir, tmp_path):
    """A setting only the worker can judge (a KV block larger than its pool) stops ``kvmesh up``
    with the worker's own one line and where its log is, not 20 lines of its log and a traceback."""
    done = kvmesh(
        "up", "--port", "0", "--dtype", "float32", "--block-size", "100000", "--kv-cache-mib", "64", "--prefill", "0",
        env={"KVMESH_CACHE_DIR": str(default_model_dir.parent.parent), "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    [workdir] = tmp_path.glob("kvmesh-up-*")  # its own temporary one: after a failure, the logs stay
    log = workdir / "logs" / "decode-1.log"
    assert done.stderr.splitlines()[-2:] == [
        f"kvmesh up: the logs are kept in {workdir / 'logs'}",
        f"kvmesh up: error: decode-1 exited with 1: a KV budget of {64 * 2**20} bytes "
        f"does not hold one 4608000000-byte block (its log: {log})",
    ]
    assert "Traceback" not in done.stderr and "Traceback" not in log.read_text()
    assert [p.name for p in workdir.iterdir()] == ["logs"]  # the mesh's credentials, CA and etcd's data went


def test_up_refuses_a_workdir_another_kvmesh_up_uses(tmp_path):
    """A second ``kvmesh up`` on the same --workdir would write its credentials, CA and
    pids.json over the first's, and the first's restarted services could not connect."""
    import fcntl

    from kvmesh.infra.up import LOCK_FILE

    workdir = tmp_path / "w"
    workdir.mkdir()
    with open(workdir / LOCK_FILE, "w") as held:  # as the running one holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        done = kvmesh("up", "--port", "0", "--workdir", str(workdir))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"kvmesh up: error: --workdir {workdir} is in use by another kvmesh up (PID 4242)\n"
    assert not (workdir / "logs").exists() and not (workdir / "pids.json").exists()


def test_up_refuses_a_model_cache_it_cannot_write(tmp_path):
    done = kvmesh("up", "--port", "0", "--workdir", str(tmp_path / "w"), env={"KVMESH_CACHE_DIR": "/proc/self/kvmesh-cache"})
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("kvmesh up: error: the model cache /proc/self/kvmesh-cache (KVMESH_CACHE_DIR) is not writable"), done.stderr
