"""The machine decides the defaults it can: ``kvmesh up``, ``kvmesh generate`` and the workers
take ``--dtype auto`` unless told otherwise (bfloat16 where the CPU has native bf16, else
float32), and ``kvmesh up`` says what it chose and why, the threads per worker included.

The suite itself runs with KVMESH_DTYPE=float32 (tests/conftest.py); these tests remove it, as
does tests/mesh/test_up.py::test_the_services_options_reach_the_services, where a running
``kvmesh up`` says its choices and hands them to its worker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvmesh import machine
from kvmesh.cli import build_parser
from kvmesh.infra.up import choose_machine_defaults
from kvmesh.settings.worker import worker_settings

MESH = ["--nats-url", "nats://127.0.0.1:1", "--etcd", "127.0.0.1:1"]  # parsed only, never dialled
NO_BF16 = "avx avx2 avx512f"
AVX512_BF16 = "avx avx2 avx512_bf16 avx512f"


@pytest.fixture
def no_dtype_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVMESH_DTYPE", raising=False)


def up_args(*argv: str):
    return build_parser().parse_args(["up", *argv])


@pytest.mark.parametrize(
    "flags, dtype, reason",
    [(AVX512_BF16, "bfloat16", "the CPU has AVX512-BF16 (native bf16)"), (NO_BF16, "float32", "the CPU has no native bf16")],
)
def test_auto_is_the_default_and_follows_the_cpu(no_dtype_env, monkeypatch, flags, dtype, reason) -> None:
    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    args = up_args()
    assert args.dtype == "auto"
    said = choose_machine_defaults(args)
    assert args.dtype == dtype
    assert said[0].startswith(f"dtype {dtype}: {reason}")
    settings = worker_settings("decode", MESH)
    assert settings.engine.dtype == dtype


def test_a_dtype_given_is_kept_and_not_announced(no_dtype_env, monkeypatch) -> None:
    monkeypatch.setattr(machine, "cpu_flags", lambda: AVX512_BF16)
    args = up_args("--dtype", "float32", "--num-threads", "1", "--no-lend-cores")
    assert choose_machine_defaults(args) == []
    assert args.dtype == "float32"
    monkeypatch.setenv("KVMESH_DTYPE", "float16")
    args = up_args("--num-threads", "1", "--no-lend-cores")
    assert (choose_machine_defaults(args), args.dtype) == ([], "float16")
    assert worker_settings("decode", MESH).engine.dtype == "float16"


@pytest.mark.parametrize("command", [["up"], ["generate", "--prompt", "x"]])
def test_a_bad_dtype_variable_is_one_clear_error(command: list[str]) -> None:
    env = {**os.environ, "KVMESH_DTYPE": "float64"}
    done = subprocess.run([sys.executable, "-m", "kvmesh.cli", *command], capture_output=True, text=True, timeout=60, env=env)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"kvmesh {command[0]}: error: KVMESH_DTYPE='float64': not one of float32, bfloat16, float16, auto\n"


def test_threads_are_the_usable_cores_split_between_the_workers(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    assert machine.threads_per_worker(2) == 3
    assert machine.threads_per_worker(8) == 1
    args = up_args("--dtype", "float32", "--prefill", "1", "--decode", "2")
    said = choose_machine_defaults(args)
    assert said == [
        "2 thread(s) per worker: 6 usable core(s) split between 3 workers (--num-threads to choose)",
        "cores lent between idle workers: a worker runs on all 6 while the others are idle, else on its 2 "
        "(--no-lend-cores to keep each to its share)",
    ]
    assert args.num_threads == 2  # what the workers are started with
    assert args.lend_cores is True


@pytest.mark.parametrize(
    "argv, lend",
    [
        ((), True),  # 1 + 1 on two cores: each worker one thread, both while the other idles
        (("--prefill", "0"), False),  # one worker has every core already
        (("--num-threads", "2"), False),  # each worker on every core: nothing to lend
        (("--device", "cuda", "--dtype", "float32"), False),  # the model runs on the GPU
        (("--no-lend-cores",), False),
        (("--lend-cores", "--prefill", "0"), True),  # asked for: kept, not announced
    ],
)
def test_cores_are_lent_by_default_where_the_workers_split_them(monkeypatch, argv, lend) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    args = up_args("--dtype", "float32", *argv)
    said = choose_machine_defaults(args)
    assert args.lend_cores is lend
    announced = [line for line in said if line.startswith("cores lent")]
    assert len(announced) == (lend and "--lend-cores" not in argv)


@pytest.mark.parametrize("engine", ["kvmesh", "vllm"])
def test_either_engines_workers_lend_by_default(monkeypatch, engine) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    args = up_args("--dtype", "float32", "--engine", engine)
    assert any(line.startswith("cores lent between idle workers") for line in choose_machine_defaults(args))
    assert args.lend_cores is True


@pytest.mark.parametrize("argv", [("--tensor-parallel-size", "2"), ("--engine-args", '{"tensor_parallel_size": 2}')])
def test_tensor_parallel_workers_lend_no_cores(monkeypatch, argv) -> None:
    """With tensor parallel 2 the mesh is 1 + 1 as without it, and no cores are lent: each
    of a worker's processes is bound to its share of the worker's."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    args = up_args("--dtype", "float32", "--engine", "vllm", *argv)
    said = choose_machine_defaults(args)
    assert (args.prefill, args.decode, args.lend_cores, args.num_threads) == (1, 1, False, 1)
    assert not any(line.startswith("cores lent") for line in said)
    args = up_args("--dtype", "float32", "--engine", "vllm")
    choose_machine_defaults(args)
    assert (args.prefill, args.lend_cores) == (1, True)  # without it, as before
