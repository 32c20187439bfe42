"""A pool's layout read from its KV tensors, in each shape vLLM's backends keep (CPU tensors
shaped like them): where each block's K and V lie, and what is refused."""

from __future__ import annotations

import pytest
import torch

from kvmesh.transfer.layout import KVMESH_ARRANGEMENT, VLLM_CPU_ARRANGEMENT, block_major
from kvmesh.worker.kv_tensors import copy_blocks, pool_layout_of

BLOCKS, TOKENS, HEADS, DIM, LAYERS = 6, 16, 2, 8, 3
PIECE = TOKENS * HEADS * DIM * 4  # float32


def addresses(layout, layer: int, block: int) -> tuple[int, int]:
    """Where the layout says block ``block``'s K and V of ``layer`` begin."""
    if layout.kv_split:
        return layout.piece_address(layer, block, 0), layout.piece_address(layer, block, 1)
    k = layout.piece_address(layer, block)
    return k, k + PIECE


def test_flash_attention_layers_allocated_one_by_one_are_listed_plane_by_plane():
    caches = [torch.zeros(2, BLOCKS, TOKENS, HEADS, DIM) for _ in range(LAYERS)]
    layout = pool_layout_of(caches, dtype="float32", block_size=TOKENS)
    assert (layout.kv_split, layout.arrangement, layout.block_stride, layout.num_blocks) == (True, "token,head,dim", PIECE, BLOCKS)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (LAYERS, HEADS, DIM)
    for layer, cache in enumerate(caches):
        for block in range(BLOCKS):
            assert addresses(layout, layer, block) == (cache[0, block].data_ptr(), cache[1, block].data_ptr())
    assert sorted(layout.regions()) == sorted((c.data_ptr(), c.numel() * 4) for c in caches)


def test_flash_attention_layers_in_one_storage_are_strided():
    storage = torch.zeros(LAYERS, 2, BLOCKS, TOKENS, HEADS, DIM)
    layout = pool_layout_of(list(storage), dtype="float32", block_size=TOKENS)
    assert not layout.planes and layout.kv_stride == BLOCKS * PIECE and layout.layer_stride == 2 * BLOCKS * PIECE
    assert addresses(layout, 2, 4) == (storage[2, 0, 4].data_ptr(), storage[2, 1, 4].data_ptr())
    assert layout.regions() == [(storage.data_ptr(), storage.numel() * 4)]


def test_the_hnd_order_is_read_from_the_strides_and_named_in_the_arrangement():
    caches = [torch.zeros(2, BLOCKS, HEADS, TOKENS, DIM).permute(0, 1, 3, 2, 4) for _ in range(LAYERS)]  # logical NHD, HND in memory
    layout = pool_layout_of(caches, dtype="float32", block_size=TOKENS)
    assert layout.arrangement == "head,token,dim" and layout.kv_split
    nhd = pool_layout_of([torch.zeros(2, BLOCKS, TOKENS, HEADS, DIM) for _ in range(LAYERS)], dtype="float32", block_size=TOKENS)
    assert layout.mismatch(nhd) == "arrangement head,token,dim (K and V apart) vs token,head,dim (K and V apart)"


def test_flash_infer_keeps_a_blocks_k_and_v_together_as_kvmesh_does():
    caches = [torch.zeros(BLOCKS, 2, TOKENS, HEADS, DIM) for _ in range(LAYERS)]
    layout = pool_layout_of(caches, dtype="float32", block_size=TOKENS)
    assert (layout.kv_split, layout.arrangement, layout.block_stride) == (False, KVMESH_ARRANGEMENT, 2 * PIECE)
    assert addresses(layout, 1, 3) == (caches[1][3, 0].data_ptr(), caches[1][3, 1].data_ptr())
    kvmesh = block_major(dtype="float32", block_size=TOKENS, num_blocks=9, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, base_address=0)
    assert layout.mismatch(kvmesh) is None


def test_ascend_k_and_v_tensors_of_each_layer_are_planes_of_their_own():
    caches = [(torch.zeros(BLOCKS, TOKENS, HEADS, DIM), torch.zeros(BLOCKS, TOKENS, HEADS, DIM)) for _ in range(LAYERS)]
    layout = pool_layout_of(caches, dtype="float32", block_size=TOKENS)
    assert layout.kv_split and len(layout.planes) == 2 * LAYERS
    assert addresses(layout, 2, 5) == (caches[2][0][5].data_ptr(), caches[2][1][5].data_ptr())
    assert len(layout.regions()) >= LAYERS  # K and V allocated apart (adjacent ones merge)


def test_other_dimension_orders_are_named_by_axes():
    """Later vLLM on CPU (CPU_ATTN): [2, blocks, heads, tokens, dim]."""
    caches = [torch.zeros(2, BLOCKS, HEADS, TOKENS, DIM) for _ in range(LAYERS)]
    layout = pool_layout_of(caches, dtype="float32", block_size=TOKENS, axes=("kv", "block", "head", "token", "dim"))
    assert (layout.arrangement, layout.num_kv_heads) == ("head,token,dim", HEADS)
    assert addresses(layout, 0, 2) == (caches[0][0, 2].data_ptr(), caches[0][1, 2].data_ptr())
    with pytest.raises(ValueError, match="blocks of 2 tokens"):  # read as FlashAttention's order
        pool_layout_of(caches, dtype="float32", block_size=TOKENS)


def vllm_views(order: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """As vLLM 0.32 builds them: one flat buffer in the KVCacheLayout ``order`` (a permutation
    of L, B, H, N, C), and each layer's [blocks, heads, tokens, 2 * dim] view of it."""
    sizes = dict(L=LAYERS, B=BLOCKS, H=HEADS, N=TOKENS, C=2 * DIM)
    buffer = torch.zeros(*(sizes[d] for d in order))
    logical = buffer.permute(*(order.index(d) for d in "LBHNC"))
    return buffer, list(logical)


def test_vllm_cpu_layers_keep_their_layout():
    buffer, caches = vllm_views("LBHNC")
    layout = pool_layout_of(caches, dtype="float32", block_size=TOKENS)
    assert (layout.arrangement, layout.layer_stride, layout.block_stride) == (VLLM_CPU_ARRANGEMENT, BLOCKS * 2 * PIECE, 2 * PIECE)
    assert not layout.planes and layout.regions() == [(buffer.data_ptr(), buffer.numel() * 4)]


def test_vllm_layouts_with_layers_inside_blocks_are_block_contiguous():
    """BLHNC: a block's every layer adjacent, as in kvmesh's pool: a run of blocks is one range."""
    buffer, caches = vllm_views("BLHNC")
    layout = pool_layout_of(caches, dtype="float32", block_size=TOKENS)
    assert (layout.layer_stride, layout.block_stride, layout.block_contiguous) == (2 * PIECE, LAYERS * 2 * PIECE, True)
    assert layout.piece_address(2, 4) == caches[2][4].data_ptr()


def test_vllm_layouts_name_their_order_inside_a_block_and_refuse_a_scattered_block():
    _, tokens_outside = vllm_views("LBNHC")
    assert pool_layout_of(tokens_outside, dtype="float32", block_size=TOKENS).arrangement == "token,head,kv,dim"
    _, heads_outside_blocks = vllm_views("LHBNC")
    with pytest.raises(ValueError, match="not one contiguous piece"):
        pool_layout_of(heads_outside_blocks, dtype="float32", block_size=TOKENS)


def test_pools_kvmesh_cannot_address_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="not one contiguous piece"):  # half the heads of a wider tensor
        pool_layout_of([torch.zeros(2, BLOCKS, TOKENS, 2 * HEADS, DIM)[:, :, :, :HEADS]], dtype="float32", block_size=TOKENS)
    with pytest.raises(ValueError, match="blocks of 16 tokens, not 32"):
        pool_layout_of([torch.zeros(2, BLOCKS, TOKENS, HEADS, DIM)], dtype="float32", block_size=32)
    shared = torch.zeros(2, BLOCKS, TOKENS, HEADS, DIM)
    with pytest.raises(ValueError, match="share KV memory"):
        pool_layout_of([shared, shared], dtype="float32", block_size=TOKENS)
    with pytest.raises(ValueError, match="differ"):
        pool_layout_of([torch.zeros(2, BLOCKS, TOKENS, HEADS, DIM), torch.zeros(2, BLOCKS + 1, TOKENS, HEADS, DIM)], dtype="float32", block_size=TOKENS)
    with pytest.raises(ValueError, match="no KV layout from a tensor of shape"):
        pool_layout_of([torch.zeros(BLOCKS, TOKENS, HEADS)], dtype="float32", block_size=TOKENS)
    with pytest.raises(ValueError, match="elements are not bfloat16"):
        pool_layout_of([torch.zeros(2, BLOCKS, TOKENS, HEADS, DIM)], dtype="bfloat16", block_size=TOKENS)
    with pytest.raises(ValueError, match="no KV tensors"):
        pool_layout_of([], dtype="float32", block_size=TOKENS)


@pytest.mark.parametrize(
    ("make", "kv_of"),
    [
        (lambda: torch.randn(2, BLOCKS, TOKENS, HEADS, DIM), lambda c, b: (c[0, b], c[1, b])),  # FlashAttention
        (lambda: torch.randn(BLOCKS, 2, TOKENS, HEADS, DIM), lambda c, b: (c[b, 0], c[b, 1])),  # FlashInfer
        (lambda: (torch.randn(BLOCKS, TOKENS, HEADS, DIM), torch.randn(BLOCKS, TOKENS, HEADS, DIM)), lambda c, b: (c[0][b], c[1][b])),
        (lambda: torch.randn(BLOCKS, HEADS, TOKENS, 2 * DIM), lambda c, b: (c[b, :, :, :DIM], c[b, :, :, DIM:])),  # vLLM CPU
    ],
)
def test_blocks_are_copied_inside_a_pool_of_each_shape(make, kv_of):
    """What a vLLM decode worker does with a prefix it staged: copy blocks into the ones vLLM
    allocated for the request, every layer, K and V, whatever the backend's shape."""
    caches = [make() for _ in range(LAYERS)]
    before = [[tuple(t.clone() for t in kv_of(c, b)) for b in range(BLOCKS)] for c in caches]
    copy_blocks(caches, [4, 1], [2, 5])
    for layer, cache in enumerate(caches):
        for block in range(BLOCKS):
            source = {2: 4, 5: 1}.get(block, block)
            assert all(torch.equal(t, want) for t, want in zip(kv_of(cache, block), before[layer][source]))
