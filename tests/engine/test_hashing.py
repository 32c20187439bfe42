"""Chained block hashes (kvmesh.hashing): the function router, workers and kv-metadata share."""

from __future__ import annotations

import hashlib
import struct

import pytest

from kvmesh.hashing import HASH_BYTES, ROOT_SEED, hash_block_tokens, hash_token_blocks

TOKENS = list(range(1, 13))  # 12 tokens: three blocks of 4


def test_root_seed_is_pinned() -> None:
    assert ROOT_SEED == 0x19D964C14C851763A17D15A9DD883D22
    assert ROOT_SEED == int.from_bytes(hashlib.sha256(b"kvmesh-block-hash-v1").digest()[:16], "little")


def test_known_values_are_pinned() -> None:
    # Computed once and hard-coded: any change of the hash function (seed, byte layout,
    # truncation, endianness) breaks cache sharing between machines and versions.
    assert hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [
        13464153387007693678563510063137277291,
        256609675378988485917282635063495154379,
    ]
    assert hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, ("m",)) == [
        133136753353442741685269247379225310751,
        207991276523307761117525699629564924213,
    ]
    assert hash_block_tokens(None, [0]) == 87578141469185389697044690836654654140


def test_byte_layout_matches_the_documented_construction() -> None:
    # h = sha256(parent LE 16 bytes | u32 count | u32 tokens | (u32 len + utf8) per key)[:16] LE
    def reference(parent: int, tokens: list[int], keys: tuple[str, ...]) -> int:
        data = parent.to_bytes(16, "little") + struct.pack("<I", len(tokens))
        data += struct.pack(f"<{len(tokens)}I", *tokens)
        for key in keys:
            raw = key.encode()
            data += struct.pack("<I", len(raw)) + raw
        return int.from_bytes(hashlib.sha256(data).digest()[:16], "little")

    h0 = reference(ROOT_SEED, [1, 2, 3, 4], ("model", "lora"))
    h1 = reference(h0, [5, 6, 7, 8], ("model", "lora"))
    assert hash_token_blocks(TOKENS[:8], 4, ("model", "lora")) == [h0, h1]


def test_only_full_blocks_are_hashed() -> None:
    assert hash_token_blocks([], 4) == []
    assert hash_token_blocks([1, 2, 3], 4) == []
    assert len(hash_token_blocks(TOKENS[:4], 4)) == 1
    assert len(hash_token_blocks(TOKENS[:7], 4)) == 1
    assert len(hash_token_blocks(TOKENS[:8], 4)) == 2
    assert len(hash_token_blocks(TOKENS, 4)) == 3
    # The partial tail does not affect the full blocks' hashes.
    assert hash_token_blocks(TOKENS[:11], 4) == hash_token_blocks(TOKENS[:8], 4)
    assert hash_token_blocks(TOKENS[:11] + [999], 4)[:2] == hash_token_blocks(TOKENS[:8], 4)


def test_chain_property_each_hash_depends_on_all_earlier_tokens() -> None:
    base = hash_token_blocks(TOKENS, 4)
    assert len(set(base)) == 3
    for pos in range(12):
        changed = list(TOKENS)
        changed[pos] += 100
        hashes = hash_token_blocks(changed, 4)
        block = pos // 4
        # Blocks before the change keep their hash; the changed block and all after differ.
        assert hashes[:block] == base[:block], pos
        for i in range(block, 3):
            assert hashes[i] != base[i], (pos, i)


def test_same_block_tokens_under_different_parents_differ() -> None:
    a = hash_token_blocks([1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = hash_token_blocks([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert a[1] != b[1]
    # A block's hash is not its tokens' hash alone: first-block hash of [9,9,9,9] differs too.
    assert hash_token_blocks([9, 9, 9, 9], 4)[0] not in (a[1], b[1])
    assert hash_block_tokens(a[0], [9, 9, 9, 9]) == a[1]


def test_extra_keys_change_every_hash() -> None:
    plain = hash_token_blocks(TOKENS, 4)
    model_a = hash_token_blocks(TOKENS, 4, ("model-a",))
    model_b = hash_token_blocks(TOKENS, 4, ("model-b",))
    two_keys = hash_token_blocks(TOKENS, 4, ("model-a", "lora"))
    assert len({*plain, *model_a, *model_b, *two_keys}) == 12
    # Keys are length-prefixed: ("ab", "c") and ("a", "bc") must not collide.
    assert hash_token_blocks(TOKENS[:4], 4, ("ab", "c")) != hash_token_blocks(TOKENS[:4], 4, ("a", "bc"))
    # A tuple or a list of the same keys is the same thing.
    assert hash_token_blocks(TOKENS, 4, ["model-a"]) == model_a


def test_extending_a_chain_equals_hashing_at_once() -> None:
    keys = ("m",)
    whole = hash_token_blocks(TOKENS, 4, keys)
    first = hash_token_blocks(TOKENS[:4], 4, keys)
    rest = hash_token_blocks(TOKENS, 4, keys, parent_hash=first[-1], start_block=1)
    assert first + rest == whole
    two = hash_token_blocks(TOKENS[:9], 4, keys)  # 2 full blocks, 1 partial token
    assert len(two) == 2
    assert two + hash_token_blocks(TOKENS, 4, keys, parent_hash=two[-1], start_block=2) == whole
    # Nothing new to hash: extending past the end gives nothing.
    assert hash_token_blocks(TOKENS, 4, keys, parent_hash=whole[-1], start_block=3) == []
    # hash_block_tokens chains the same way.
    parent = None
    for i, expected in enumerate(whole):
        parent = hash_block_tokens(parent, TOKENS[4 * i : 4 * i + 4], keys)
        assert parent == expected


def test_extending_without_parent_is_an_error() -> None:
    with pytest.raises(ValueError, match="parent hash"):
        hash_token_blocks(TOKENS, 4, start_block=1)


def test_deterministic_across_calls_and_inputs_not_mutated() -> None:
    tokens = list(TOKENS)
    first = hash_token_blocks(tokens, 4, ("x",))
    for _ in range(3):
        assert hash_token_blocks(tokens, 4, ("x",)) == first
        assert hash_token_blocks(tuple(tokens), 4, ("x",)) == first
    assert tokens == TOKENS


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_hashes_are_128_bit_ints(block_size: int) -> None:
    assert HASH_BYTES == 16
    hashes = hash_token_blocks(list(range(48)) + [2**32 - 1], block_size, ("k",))
    assert len(hashes) == 49 // block_size
    for h in hashes:
        assert isinstance(h, int)
        assert 0 <= h < 2**128
    assert len(set(hashes)) == len(hashes)
    # Over many hashes the top bits get used (not a narrower value zero-extended).
    assert max(hash_token_blocks(list(range(256)), 1)) >= 2**120


def test_block_size_changes_hashes() -> None:
    assert hash_token_blocks(TOKENS[:8], 8)[0] != hash_token_blocks(TOKENS[:8], 4)[1]


@pytest.mark.parametrize("block_size", [0, -1, -16])
def test_bad_block_size(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        hash_token_blocks(TOKENS, block_size)
