"""Block runs and a real Mooncake transfer between two engines."""

from __future__ import annotations

import os

import pytest
import torch

from kvmesh.transfer.layout import VLLM_CPU_ARRANGEMENT, PoolLayout, block_major
from kvmesh.transfer.mooncake_agent import MooncakeAgent, TransferError
from kvmesh.transfer.runs import BlockRun, byte_ranges, coalesce
from kvmesh.worker.kv_tensors import pool_layout_of


def test_coalesce_adjacent_on_both_sides():
    assert coalesce([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [BlockRun(4, 0, 3), BlockRun(9, 3, 2)]
    assert coalesce([1, 2, 3], [7, 9, 10]) == [BlockRun(1, 7, 1), BlockRun(2, 9, 2)]
    assert coalesce([], []) == []
    with pytest.raises(ValueError):
        coalesce([1], [])


def test_byte_ranges():
    src, dst, lengths = byte_ranges([BlockRun(4, 0, 3), BlockRun(9, 3, 2)], src_base=1000, dst_base=0, block_bytes=10)
    assert (src, dst, lengths) == ([1040, 1090], [0, 30], [30, 20])


def test_pull_blocks_between_two_pools():
    block_bytes = 4096
    peer_pool = torch.arange(16 * block_bytes // 4, dtype=torch.int32)
    local_pool = torch.zeros_like(peer_pool)
    peer, local = MooncakeAgent(), MooncakeAgent()
    peer.register(peer_pool.data_ptr(), peer_pool.numel() * 4)
    local.register(local_pool.data_ptr(), local_pool.numel() * 4)
    src, dst = [3, 4, 5, 11], [0, 1, 2, 7]
    stats = local.read_blocks(
        peer.endpoint, coalesce(src, dst), peer_base=peer_pool.data_ptr(), local_base=local_pool.data_ptr(), block_bytes=block_bytes
    )
    assert stats.bytes == 4 * block_bytes and stats.ranges == 2
    per_block = block_bytes // 4
    for s, d in zip(src, dst):
        assert torch.equal(local_pool[d * per_block : (d + 1) * per_block], peer_pool[s * per_block : (s + 1) * per_block])
    assert local.bytes_read == 4 * block_bytes
    with pytest.raises(TransferError):  # beyond what the peer registered
        local.read_blocks(peer.endpoint, [BlockRun(16, 0, 1)], peer_base=peer_pool.data_ptr(), local_base=local_pool.data_ptr(), block_bytes=block_bytes)



def test_pull_a_layer_major_pool_by_its_published_layout():
    """vLLM-on-CPU-like pools: a tensor [blocks, heads, tokens, 2 * dim] per layer, all views
    of one storage; every layer's segments of the blocks land where the local layout says."""
    layers, heads, tokens, dim = 3, 2, 16, 8
    peer_kv = torch.randn(layers, 8, heads, tokens, 2 * dim)
    local_kv = torch.zeros(layers, 12, heads, tokens, 2 * dim)  # another pool size: other layer stride

    def layout(kv: torch.Tensor) -> PoolLayout:
        return PoolLayout(
            engine="vllm", dtype="float32", block_size=tokens, num_blocks=kv.shape[1], num_layers=layers, num_kv_heads=heads,
            head_dim=dim, layer_stride=kv.stride(0) * 4, block_stride=kv.stride(1) * 4, arrangement=VLLM_CPU_ARRANGEMENT,
            base_address=kv.data_ptr(), pool_bytes=kv.numel() * 4,
        )  # fmt: skip

    peer, local = MooncakeAgent(), MooncakeAgent()
    peer.register(peer_kv.data_ptr(), peer_kv.numel() * 4)
    local.register(local_kv.data_ptr(), local_kv.numel() * 4)
    src, dst = [2, 3, 6], [9, 10, 0]
    stats = local.read_layout(peer.endpoint, coalesce(src, dst), peer=layout(peer_kv), local=layout(local_kv))
    assert stats.ranges == 2 * layers and stats.bytes == 3 * layers * heads * tokens * 2 * dim * 4
    assert torch.equal(local_kv[:, dst], peer_kv[:, src])
    assert local_kv.sum(dim=(0, 2, 3, 4)).nonzero().flatten().tolist() == sorted(dst)  # nothing else written
    with pytest.raises(TransferError, match="reaches past a pool"):
        local.read_layout(peer.endpoint, [BlockRun(7, 0, 2)], peer=layout(peer_kv), local=layout(local_kv))


class Pool:
    """A pool of float32 KV tensors shaped as one engine keeps them, with its K and V of
    (layer, block) as [tokens, heads, dim] views."""

    LAYERS, TOKENS, HEADS, DIM = 3, 16, 2, 8

    def __init__(self, kind: str, num_blocks: int) -> None:
        L, T, H, D = self.LAYERS, self.TOKENS, self.HEADS, self.DIM
        self.kind = kind
        if kind == "kvmesh":  # one tensor [blocks, layers, 2, tokens, heads, dim]
            self.tensor = torch.zeros(num_blocks, L, 2, T, H, D)
            self.layout = block_major(
                dtype="float32", block_size=T, num_blocks=num_blocks, num_layers=L, num_kv_heads=H, head_dim=D, base_address=self.tensor.data_ptr()
            )
            return
        if kind in ("vllm-LBHNC", "vllm-BLHNC"):  # vLLM 0.32: [blocks, heads, tokens, 2 * dim] views of one buffer
            order = kind[-5:]
            sizes = dict(L=L, B=num_blocks, H=H, N=T, C=2 * D)
            self.buffer = torch.zeros(*(sizes[d] for d in order))
            self.caches = list(self.buffer.permute(*(order.index(d) for d in "LBHNC")))
        elif kind == "flash-attn":  # [2, blocks, tokens, heads, dim] per layer, allocated one by one
            self.caches: list = [torch.zeros(2, num_blocks, T, H, D) for _ in range(L)]
        elif kind == "flash-infer":  # [blocks, 2, tokens, heads, dim] per layer
            self.caches = [torch.zeros(num_blocks, 2, T, H, D) for _ in range(L)]
        elif kind == "ascend":  # (K, V) of [blocks, tokens, heads, dim] per layer
            self.caches = [(torch.zeros(num_blocks, T, H, D), torch.zeros(num_blocks, T, H, D)) for _ in range(L)]
        else:
            raise ValueError(kind)
        self.layout = pool_layout_of(self.caches, dtype="float32", block_size=T)

    def kv(self, layer: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "kvmesh":
            return self.tensor[block, layer, 0], self.tensor[block, layer, 1]
        cache = self.caches[layer]
        if self.kind.startswith("vllm-"):  # the CPU kernels' order: a head's K for every token, then its V
            block_kv = cache[block].reshape(self.HEADS, 2, self.TOKENS, self.DIM)
            return block_kv[:, 0], block_kv[:, 1]
        if self.kind == "flash-attn":
            return cache[0, block], cache[1, block]
        if self.kind == "flash-infer":
            return cache[block, 0], cache[block, 1]
        return cache[0][block], cache[1][block]

    def fill(self) -> None:
        for layer in range(self.LAYERS):
            for block in range(self.layout.num_blocks):
                for t in self.kv(layer, block):
                    t.copy_(torch.randn_like(t))

    def register(self, agent: MooncakeAgent) -> None:
        for address, nbytes in self.layout.regions():
            agent.register(address, nbytes)


@pytest.mark.parametrize(
    ("producer", "consumer"),
    [
        ("flash-attn", "flash-attn"), ("ascend", "kvmesh"), ("kvmesh", "flash-attn"), ("flash-infer", "kvmesh"),
        ("flash-attn", "ascend"), ("vllm-BLHNC", "vllm-LBHNC"), ("vllm-LBHNC", "vllm-BLHNC"),
    ],
)
def test_pulls_between_pools_of_other_engines_land_each_blocks_k_and_v_where_they_belong(producer, consumer):
    """Layouts read from tensors shaped as vLLM 0.32 keeps them in two KVCacheLayouts, as
    earlier vLLM's FlashAttention and FlashInfer and vllm-ascend keep them (K and V apart,
    layers allocated one by one), and kvmesh's: a real Mooncake pull between two of them
    moves every layer's K and V of each block, and nothing else."""
    peer_pool, local_pool = Pool(producer, 8), Pool(consumer, 12)
    peer_pool.fill()
    peer, local = MooncakeAgent(), MooncakeAgent()
    peer_pool.register(peer)
    local_pool.register(local)
    src, dst = [2, 3, 6], [9, 10, 0]
    stats = local.read_layout(peer.endpoint, coalesce(src, dst), peer=peer_pool.layout, local=local_pool.layout)
    assert stats.bytes == 3 * peer_pool.layout.block_bytes
    for layer in range(Pool.LAYERS):
        for block in range(12):
            k, v = local_pool.kv(layer, block)
            if block in dst:
                want_k, want_v = peer_pool.kv(layer, src[dst.index(block)])
                assert torch.equal(k, want_k) and torch.equal(v, want_v), (layer, block)
            else:
                assert not k.any() and not v.any(), (layer, block)  # nothing else written


def test_a_pull_between_nhd_and_hnd_pools_is_refused():
    nhd = Pool("flash-attn", 4)
    hnd = pool_layout_of(
        [torch.zeros(2, 4, Pool.HEADS, Pool.TOKENS, Pool.DIM).permute(0, 1, 3, 2, 4) for _ in range(Pool.LAYERS)], dtype="float32", block_size=Pool.TOKENS
    )
    local = MooncakeAgent()
    with pytest.raises(TransferError, match="arrangement token,head,dim .K and V apart. vs head,token,dim"):
        local.read_layout(local.endpoint, [BlockRun(0, 0, 1)], peer=nhd.layout, local=hnd)


LISTENERS = """
import json, os, sys
from kvmesh.transfer.mooncake_agent import MooncakeAgent
low, high = int(sys.argv[1]), int(sys.argv[2])
agent = MooncakeAgent(port_range=(low, high))
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if target.startswith("socket:["):
        inodes.add(target[8:-1])
ports = set()
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # LISTEN, and this process's
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
print(json.dumps({"endpoint": agent.endpoint, "listening": sorted(ports)}))
"""


def test_the_transfer_engine_listens_inside_the_given_port_range():
    import json
    import subprocess
    import sys

    from tests.mesh.meshes import free_port_range

    low, _ = free_port_range(16)
    done = subprocess.run([sys.executable, "-c", LISTENERS, str(low), str(low + 15)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    port = int(result["endpoint"].rsplit(":", 1)[1])
    assert low <= port <= low + 15
    # Both of the engine's listeners (handshake and data) are in the range, and nothing else.
    assert len(result["listening"]) == 2 and all(low <= p <= low + 15 for p in result["listening"]), result


def test_port_ranges_parse():
    from kvmesh.transfer.mooncake_agent import parse_port_range

    assert parse_port_range("20000-20015") == (20000, 20015)
    assert parse_port_range("20000") == (20000, 20000)
    for bad in ("x-y", "20010-20000", "0-5", "20000-40000"):
        with pytest.raises(ValueError):
            parse_port_range(bad)


class _EngineTakingPorts:
    """A fake Mooncake engine whose first ``busy`` starts find a port taken, the way a
    worker starting beside another on the same range does (unit test of the retry only)."""

    starts = 0
    busy = 0

    def initialize(self, hostname, metadata, protocol, device):  # noqa: ANN001
        cls = type(self)
        cls.starts += 1
        if cls.starts <= cls.busy:
            if cls.starts % 2:
                raise RuntimeError("bind: Address already in use")
            return -1  # the transport's port taken: Mooncake logs it and returns -1
        return 0

    def get_rpc_port(self) -> int:
        return 20001


@pytest.mark.parametrize("busy", [1, 2, 5])
def test_a_taken_transfer_port_is_picked_again(monkeypatch, busy):
    import mooncake.engine

    monkeypatch.setattr(_EngineTakingPorts, "starts", 0)
    monkeypatch.setattr(_EngineTakingPorts, "busy", busy)
    monkeypatch.setattr(mooncake.engine, "TransferEngine", _EngineTakingPorts)
    monkeypatch.setattr("kvmesh.transfer.mooncake_agent.time.sleep", lambda _: None)
    agent = MooncakeAgent(port_range=(20000, 20003))
    assert agent.endpoint == "127.0.0.1:20001" and _EngineTakingPorts.starts == busy + 1


def test_ports_taken_on_every_try_are_one_clear_error(monkeypatch):
    import mooncake.engine

    from kvmesh.transfer import mooncake_agent

    monkeypatch.setattr(_EngineTakingPorts, "starts", 0)
    monkeypatch.setattr(_EngineTakingPorts, "busy", 100)
    monkeypatch.setattr(mooncake.engine, "TransferEngine", _EngineTakingPorts)
    monkeypatch.setattr("kvmesh.transfer.mooncake_agent.time.sleep", lambda _: None)
    with pytest.raises(TransferError, match=r"did not start in \d+ tries, ports 20000-20003"):
        MooncakeAgent(port_range=(20000, 20003))
    assert _EngineTakingPorts.starts == mooncake_agent.START_ATTEMPTS


PAIRED_START = """
import sys
from kvmesh.transfer.mooncake_agent import MooncakeAgent
agent = MooncakeAgent(port_range=(int(sys.argv[1]), int(sys.argv[2])))
print(agent.endpoint)
sys.stdin.read()  # hold the ports until the test has both endpoints
"""


def test_workers_starting_together_on_one_small_range_all_start():
    """Two processes' real engines at once on a shared 8-port range, six times: each picks
    its ports at random, so they collide now and then (without the retry 1 in 12 pairs failed
    on 16 ports; with it, 1 in 15 pairs on 8 ports needed a second try); every one must start,
    on ports of its own. The fake-engine tests above pin the retry down deterministically."""
    import subprocess
    import sys

    from tests.mesh.meshes import free_port_range

    for _ in range(6):
        low, high = free_port_range(8)
        procs = [subprocess.Popen([sys.executable, "-c", PAIRED_START, str(low), str(high)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
        endpoints = []
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            endpoints.append(line)
        errors = [proc.communicate("", timeout=30)[1] for proc in procs]
        assert all(proc.returncode == 0 for proc in procs), [e[-1500:] for e in errors]
        ports = [int(e.rsplit(":", 1)[1]) for e in endpoints]
        assert len(set(ports)) == 2 and all(low <= p <= high for p in ports), endpoints


def test_the_port_variables_an_agent_sets_are_gone_after_its_test(monkeypatch):
    """Pins tests/conftest.py's guard: MooncakeAgent puts its range in os.environ (the way it
    reaches Mooncake); the suite's autouse fixture takes it away again after each test."""
    import mooncake.engine

    monkeypatch.setattr(mooncake.engine, "TransferEngine", _EngineTakingPorts)
    monkeypatch.setattr(_EngineTakingPorts, "busy", 0)
    MooncakeAgent(port_range=(20000, 20003))
    assert os.environ["MC_MIN_RPC_PORT"] == "20000"


def test_and_they_are_gone():
    assert os.environ.get("MC_MIN_RPC_PORT") != "20000"


HOLD_THE_START = """
import sys
from kvmesh.transfer.mooncake_agent import one_start_at_a_time
from pathlib import Path
with one_start_at_a_time(Path(sys.argv[1]), wait=float(sys.argv[2])):
    print("inside", flush=True)
    sys.stdin.readline()
print("out", flush=True)
"""


def test_kvmesh_processes_start_their_engines_one_at_a_time(tmp_path, caplog):
    """The start lock: a second process waits while the first holds it, goes in once it is
    let go; one that waits past its limit goes on without it, with one warning."""
    import subprocess
    import sys

    from kvmesh.transfer.mooncake_agent import one_start_at_a_time

    lock = tmp_path / "start.lock"

    def holder(wait: float) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", HOLD_THE_START, str(lock), str(wait)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip

    first = holder(30)
    assert first.stdout is not None and first.stdin is not None
    assert first.stdout.readline().strip() == "inside"
    second = holder(30)
    assert second.stdout is not None and second.stdin is not None
    with caplog.at_level("WARNING"), one_start_at_a_time(lock, wait=0.3):  # held: goes on after 0.3 s
        pass
    assert [r.message for r in caplog.records if "start lock" in r.message] == [
        f"Mooncake starts without the start lock: {lock} held for 0 s"
    ]
    assert second.poll() is None  # still waiting
    first.stdin.write("\n")
    first.stdin.flush()
    assert first.stdout.readline().strip() == "out"
    assert second.stdout.readline().strip() == "inside"  # in once the first let go
    second.stdin.write("\n")
    second.stdin.flush()
    assert second.stdout.readline().strip() == "out"
    assert first.wait(10) == 0 and second.wait(10) == 0
