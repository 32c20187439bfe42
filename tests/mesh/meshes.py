"""Starting a local mesh for an end-to-end test, and what every fault test checks after."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time
from pathlib import Path
from typing import Any

from kvmesh.cluster.etcd_store import EtcdStore
from kvmesh.infra.local_mesh import LocalMesh, MeshOptions
from kvmesh.protocol import Keys
from tests.mesh.client import worker_stats

MODEL = "SmolLM2-135M-Instruct"
LEASE_TTL = 2  # seconds: a dead worker's record leaves etcd this soon
# The prompts whose greedy answers through a mesh are compared with one process's.
PROMPTS = [
    "The capital of France is",
    "Here is a list of three fruits:",
    "def square(x):\n",
    "The ocean is deep and",
    "Once upon a time, a small robot",
    "Water freezes at",
    "The best way to learn a language is",
    "In 1969, astronauts",
]
NEW_TOKENS = 20


def make_mesh(
    tmp_path: Path, default_model_dir: Path, *, prefill: int, decode: int, env: dict | None = None, **options: Any
) -> LocalMesh:
    """A started mesh of small workers (one thread each, 32 MiB pools unless told), reusing
    the session's converted default model."""
    settings: dict[str, Any] = dict(kv_cache_mib=32, lease_ttl=LEASE_TTL, pin_ttl=10, request_timeout=20, num_threads=1)
    settings.update(options)
    env = {"KVMESH_CACHE_DIR": str(default_model_dir.parent.parent), **(env or {})}
    mesh = LocalMesh(MeshOptions(prefill=prefill, decode=decode, env=env, **settings), tmp_path)
    mesh.start()
    return mesh


async def assert_pools_at_baseline(mesh: LocalMesh, worker_ids: list[str]) -> None:
    """Every block of these workers free or cached: none in use, held or pinned (waiting
    up to 5 s for releases in flight)."""
    for worker_id in worker_ids:
        for _ in range(50):
            stats = await worker_stats(mesh.nats.url, "default", worker_id, **mesh.nats.connect_options())
            if (stats.num_in_use, stats.num_held, stats.pins) == (0, 0, 0):
                break
            await asyncio.sleep(0.1)
        assert (stats.num_in_use, stats.num_held, stats.pins) == (0, 0, 0), stats


def process_gone(pid: int) -> bool:
    """No such process, or only its zombie left (not ours to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, or going while read
        return True


def listening(pid: int) -> list[tuple[str, int]]:
    """The TCP sockets process ``pid`` listens on, as (address, port): its socket inodes
    (``/proc/<pid>/fd``) looked up in its network namespace's tables."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_address, hex_port = local.split(":")
            raw = bytes.fromhex(hex_address)  # host-order 32-bit words
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((socket.inet_ntop(family, packed), int(hex_port, 16)))
    return found


def free_port_range(count: int) -> tuple[int, int]:
    """``count`` ports, all free now, below Mooncake's limit of 32767."""

    def free(port: int) -> bool:
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                return False
        return True

    for base in random.sample(range(20000, 32700, count), 100):
        if all(free(port) for port in range(base, base + count)):
            return base, base + count - 1
    raise RuntimeError("no free port range")


async def wait_for_a_pin(store: EtcdStore, worker_ids: list[str], timeout: float = 30) -> str | None:
    """The first of these prefill workers seen holding a pin (a prefill done, its pull
    pending), or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for worker_id in worker_ids:
            pins, _ = await store.get_prefix(Keys("default").pins(worker_id))
            if pins:
                return worker_id
        await asyncio.sleep(0.02)
    return None


# Two tools the tool-calling tests offer the model (official client, LangChain, LiteLLM, vLLM workers)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"], "additionalProperties": False},
    },
}
