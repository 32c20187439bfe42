"""Chained KV block hashes: the one function the router, the workers and kv-metadata share.

A block is ``block_size`` consecutive tokens. Its hash chains on its parent's hash so that a
block hash names the whole prefix up to and including it:
``h_i = H(h_{i-1}, tokens_i, extra_keys)``, with a fixed root seed for the first block.
``extra_keys`` carry what else changes the KV (the model name; later a LoRA adapter or a
cache salt). Only full blocks are hashed. Hashes are 128-bit integers (truncated SHA-256),
wide enough that a collision is not a practical concern, and the same on every machine.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = int

HASH_BYTES = 16
ROOT_SEED: BlockHash = int.from_bytes(hashlib.sha256(b"kvmesh-block-hash-v1").digest()[:HASH_BYTES], "little")


def _encode_extra_keys(extra_keys: Sequence[str]) -> bytes:
    out = bytearray()
    for key in extra_keys:
        raw = str(key).encode("utf-8")
        out += struct.pack("<I", len(raw)) + raw
    return bytes(out)


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """Hash of one full block, chained on its parent (``None`` for the first block)."""
    return _hash_block(parent_hash, token_ids, _encode_extra_keys(extra_keys))


def _hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int], encoded_extra_keys: bytes) -> BlockHash:
    parent = ROOT_SEED if parent_hash is None else parent_hash
    digest = hashlib.sha256()
    digest.update(parent.to_bytes(HASH_BYTES, "little"))
    digest.update(struct.pack("<I", len(token_ids)))
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    digest.update(encoded_extra_keys)
    return int.from_bytes(digest.digest()[:HASH_BYTES], "little")


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str] = (),
    *,
    parent_hash: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block ``start_block`` on.

    ``parent_hash`` is the hash of block ``start_block - 1`` (``None`` when starting at 0), so
    a caller can extend an already hashed prefix without rehashing it.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start_block > 0 and parent_hash is None:
        raise ValueError("extending a chain needs the parent hash of the previous block")
    hashes: list[BlockHash] = []
    parent = parent_hash
    extra = _encode_extra_keys(extra_keys)  # once for the chain, not per block
    for start in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent = _hash_block(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes


def hash_to_hex(block_hash: BlockHash) -> str:
    """The wire form of a block hash: 32 lowercase hex digits (JSON numbers lose bits)."""
    return f"{block_hash:032x}"


def hash_from_hex(text: str) -> BlockHash:
    if len(text) != 2 * HASH_BYTES:
        raise ValueError(f"a block hash is {2 * HASH_BYTES} hex digits, got {text!r}")
    return int(text, 16)
