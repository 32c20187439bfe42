"""A pool's layout read from the KV tensors an engine holds, not assumed from its device.

vLLM's attention backends keep a layer's KV cache in one of these shapes (dimension names
are logical; the memory order is read from the strides):

- CPU: ``[blocks, heads, tokens, 2 * dim]``, each head's K for every token then its V;
- FlashAttention (CUDA): ``[2, blocks, tokens, heads, dim]``, K of every block then V of
  every block, ``tokens`` and ``heads`` swapped in memory under the HND layout;
- FlashInfer (CUDA): ``[blocks, 2, tokens, heads, dim]``, a block's K then its V;
- vllm-ascend (NPU): a ``(K, V)`` pair of ``[blocks, tokens, heads, dim]`` tensors;
- later vLLM on CPU (``CPU_ATTN``): ``[2, blocks, heads, tokens, dim]`` (``axes`` says so).

A block's K (or V) must be one contiguous piece whatever the order inside it; that order
becomes the layout's arrangement, so two pools whose pieces differ (NHD and HND) are not
paired.

The layers are views of one storage evenly spaced (vLLM on CPU) or separate allocations
(one per layer on CUDA and NPU); the layout names their planes one by one then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh.transfer.layout import KV_FIRST, VLLM_CPU_ARRANGEMENT, PoolLayout

PIECE_DIMS = ("token", "head", "dim")  # the dimensions of a [blocks, tokens, heads, dim] view after blocks
# What each dimension of a layer's KV tensor is, by backend (``axes`` names others)
PAIR_AXES = ("block", "token", "head", "dim")  # each tensor of a (K, V) pair (vllm-ascend)
FLASH_ATTN_AXES = ("kv", "block", "token", "head", "dim")  # FlashAttention
FLASH_INFER_AXES = ("block", "kv", "token", "head", "dim")  # FlashInfer


def pool_layout_of(
    caches: Sequence[Any], *, dtype: str, block_size: int, engine: str = "vllm", axes: Sequence[str] | None = None
) -> PoolLayout:
    """The layout of a pool held as ``caches``, one entry per layer: a tensor in one of the
    shapes above, or a ``(K, V)`` pair. ``axes`` names each dimension of a layer's tensor
    ("kv", "block", "token", "head", "dim") where it is not the backend's usual order (a
    5-dimensional tensor is FlashAttention's when its first dimension is 2, FlashInfer's
    otherwise). ValueError for anything else, or for layers that disagree or share memory."""
    if not caches:
        raise ValueError("no KV tensors to read a layout from")
    first = caches[0]
    if axes is None and not isinstance(first, (tuple, list)) and first.dim() == 4:
        return _cpu_layout(caches, dtype=dtype, block_size=block_size, engine=engine)
    layers = [_layer(entry, block_size, axes) for entry in caches]
    block_stride, arrangement, num_blocks, heads, dim, itemsize = layers[0].shape
    if any(layer.shape != layers[0].shape for layer in layers):
        raise ValueError("the layers' KV tensors differ in shape or memory order")
    piece = block_size * heads * dim * itemsize
    joint = all(v == k + piece for k, v in (layer.addresses for layer in layers)) and block_stride >= 2 * piece
    planes = [k for layer in layers for k in (layer.addresses[:1] if joint else layer.addresses)]
    if len(set(planes)) != len(planes):
        raise ValueError("layers share KV memory (a hybrid model's groups): kvmesh moves one pool per layer")
    strided = _strided(layers, planes, joint)
    if strided is not None:
        base, layer_stride, kv_stride, pool_bytes = strided
        listed: tuple[int, ...] = ()
    else:  # separate allocations: each plane named
        base, layer_stride, kv_stride, listed = min(planes), 0, 0, tuple(planes)
        pool_bytes = max(planes) + (num_blocks - 1) * block_stride + (2 * piece if joint else piece) - base
    return PoolLayout(
        engine=engine, dtype=dtype, block_size=block_size, num_blocks=num_blocks, num_layers=len(layers),
        num_kv_heads=heads, head_dim=dim, layer_stride=layer_stride, block_stride=block_stride,
        arrangement=KV_FIRST + arrangement if joint else arrangement, base_address=base, pool_bytes=pool_bytes,
        kv_split=not joint, kv_stride=kv_stride, planes=listed,
    )  # fmt: skip


class _Layer:
    """One layer's K and V as ``[blocks, tokens, heads, dim]`` views."""

    def __init__(self, k: Any, v: Any) -> None:
        if tuple(k.stride()) != tuple(v.stride()) or tuple(k.shape) != tuple(v.shape):
            raise ValueError("a layer's K and V tensors differ in shape or memory order")
        num_blocks, _, heads, dim = k.shape
        itemsize = k.element_size()
        order = sorted(range(1, 4), key=lambda d: k.stride(d), reverse=True)  # memory order, outermost first
        expected = 1
        for d in reversed(order):  # dense: each dimension spans exactly the ones inside it
            if k.stride(d) != expected and k.shape[d] > 1:
                raise ValueError(f"a block's KV piece is not contiguous (shape {tuple(k.shape)}, strides {tuple(k.stride())})")
            expected *= k.shape[d]
        self.shape = (k.stride(0) * itemsize, ",".join(PIECE_DIMS[d - 1] for d in order), num_blocks, heads, dim, itemsize)
        self.addresses = (k.data_ptr(), v.data_ptr())
        self.storage = k.untyped_storage()


def _layer(entry: Any, block_size: int, axes: Sequence[str] | None) -> _Layer:
    if isinstance(entry, (tuple, list)):
        if len(entry) != 2 or entry[0].dim() != 4:
            raise ValueError("a layer's (K, V) pair must be two 4-dimensional tensors")
        names = tuple(axes or PAIR_AXES)
        k, v = (_viewed(t, names, block_size) for t in entry)
    elif entry.dim() == 5:
        names = tuple(axes or (FLASH_ATTN_AXES if entry.shape[0] == 2 else FLASH_INFER_AXES))
        if sorted(names) != sorted(FLASH_ATTN_AXES) or entry.shape[names.index("kv")] != 2:
            raise ValueError(f"the KV tensor's dimensions {names} do not name K/V, blocks, tokens, heads and dim (shape {tuple(entry.shape)})")
        kv = names.index("kv")
        rest = names[:kv] + names[kv + 1 :]
        k, v = (_viewed(entry.select(kv, i), rest, block_size) for i in (0, 1))
    else:
        raise ValueError(f"kvmesh reads no KV layout from a tensor of shape {tuple(entry.shape)}")
    return _Layer(k, v)


def _viewed(tensor: Any, names: tuple[str, ...], block_size: int) -> Any:
    """``tensor`` (dimensions named ``names``) as a ``[blocks, tokens, heads, dim]`` view."""
    if sorted(names) != sorted(PAIR_AXES) or tensor.dim() != 4:
        raise ValueError(f"the KV tensor's dimensions {names} do not name blocks, tokens, heads and dim (shape {tuple(tensor.shape)})")
    view = tensor.permute(*(names.index(name) for name in PAIR_AXES))
    if view.shape[1] != block_size:
        raise ValueError(f"the KV tensors hold blocks of {view.shape[1]} tokens, not {block_size}")
    return view


def _strided(layers: list[_Layer], planes: list[int], joint: bool) -> tuple[int, int, int, int] | None:
    """(base, layer stride, K-to-V stride, pool bytes) where every layer is a view of one
    storage, evenly spaced (V after K); ``None`` where the planes must be listed."""
    storage = layers[0].storage
    if any(layer.storage.data_ptr() != storage.data_ptr() for layer in layers):
        return None
    parts = 1 if joint else 2
    base = planes[0]
    pool_bytes = storage.nbytes() - (base - storage.data_ptr())
    layer_stride = planes[parts] - base if len(layers) > 1 else pool_bytes
    kv_stride = 0 if joint else planes[1] - base
    if layer_stride <= 0 or (not joint and kv_stride <= 0):
        return None
    for i, address in enumerate(planes):
        layer, part = divmod(i, parts)
        if address != base + layer * layer_stride + part * kv_stride:
            return None
    return base, layer_stride, kv_stride, pool_bytes


def _cpu_layout(caches: Sequence[Any], *, dtype: str, block_size: int, engine: str) -> PoolLayout:
    """vLLM on CPU: ``[blocks, heads, tokens, 2 * dim]`` per layer, views of one storage."""
    first = caches[0]
    if first.shape[2] != block_size or first.shape[3] % 2 or not first.is_contiguous():
        raise ValueError(f"kvmesh reads vLLM's CPU KV layout [blocks, heads, {block_size} tokens, 2 * dim]; got {tuple(first.shape)}")
    num_blocks, heads, _, width = first.shape
    itemsize = first.element_size()
    storage = first.untyped_storage()
    base = first.data_ptr()
    layer_stride = caches[1].data_ptr() - base if len(caches) > 1 else first.numel() * itemsize
    for i, cache in enumerate(caches):
        if tuple(cache.shape) != tuple(first.shape) or cache.untyped_storage().data_ptr() != storage.data_ptr() or cache.data_ptr() != base + i * layer_stride:
            raise ValueError("vLLM's CPU KV tensors are not evenly spaced views of one storage")
    return PoolLayout(
        engine=engine,
        dtype=dtype,
        block_size=block_size,
        num_blocks=num_blocks,
        num_layers=len(caches),
        num_kv_heads=heads,
        head_dim=width // 2,
        layer_stride=layer_stride,
        block_stride=first.stride(0) * itemsize,
        arrangement=VLLM_CPU_ARRANGEMENT,
        base_address=base,
        pool_bytes=storage.nbytes() - (base - storage.data_ptr()),
    )


def copy_blocks(caches: Sequence[Any], src: Sequence[int], dst: Sequence[int], *, axes: Sequence[str] | None = None) -> None:
    """Copy blocks ``src[i]`` to ``dst[i]`` in every layer of a pool held as ``caches`` (the
    shapes ``pool_layout_of`` reads), on the tensors' own device."""
    import torch

    for entry in caches:
        paired = isinstance(entry, (tuple, list))
        for tensor in entry if paired else (entry,):
            axis = _block_axis(tensor, paired, axes)
            to = torch.tensor(list(dst), dtype=torch.long, device=tensor.device)
            taken = tensor.index_select(axis, torch.tensor(list(src), dtype=torch.long, device=tensor.device))
            tensor.index_copy_(axis, to, taken)


def _block_axis(tensor: Any, paired: bool, axes: Sequence[str] | None) -> int:
    if axes is not None:
        return tuple(axes).index("block")
    if paired:
        return PAIR_AXES.index("block")
    if tensor.dim() == 5:
        return (FLASH_ATTN_AXES if tensor.shape[0] == 2 else FLASH_INFER_AXES).index("block")
    return 0  # vLLM on CPU: [blocks, heads, tokens, 2 * dim]
