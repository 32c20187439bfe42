"""A pool's layout read from the KV tensors an engine holds, not assumed from its device.

vLLM 0.32 (the pinned version) keeps every attention layer's KV cache as a view
``[blocks, heads, tokens, 2 * dim]`` of a flat buffer, whatever the backend; the memory order
is the model's ``KVCacheLayout`` (``LBHNC`` by default and the only one on CPU, ``LBNHC`` with
tokens outside heads, ``BLHNC`` with layers inside blocks, ...), read here from the strides.
Inside a head and token of CUDA's backends the last dimension holds the token's K then its V
(``head,token,kv,dim``); vLLM's CPU kernels keep each head's K for every token of the block,
then its V (``VLLM_CPU_ARRANGEMENT``, measured).

Earlier vLLM releases and vllm-ascend kept other shapes, read here too (the dimension names
are logical, the memory order again from the strides):

- FlashAttention: ``[2, blocks, tokens, heads, dim]``, K of every block then V of every
  block; ``tokens`` and ``heads`` swapped in memory under the HND layout;
- FlashInfer: ``[blocks, 2, tokens, heads, dim]``, a block's K then its V;
- vllm-ascend: a ``(K, V)`` pair of ``[blocks, tokens, heads, dim]`` tensors;
- ``axes`` names the dimensions of any other order (CPU_ATTN's ``[2, blocks, heads, tokens, dim]``).

The layers are views of one storage evenly spaced, or separate allocations (one per layer,
or per K and V); the layout names their planes one by one then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.transfer.layout import KV_FIRST, VLLM_CPU_ARRANGEMENT, PoolLayout

# What each dimension of a layer's KV tensor is, by shape (``axes`` names others)
PACKED_AXES = ("block", "head", "token", "content")  # vLLM 0.32: content is a token's K then V
PAIR_AXES = ("block", "token", "head", "dim")  # each tensor of a (K, V) pair (vllm-ascend)
FLASH_ATTN_AXES = ("kv", "block", "token", "head", "dim")  # earlier vLLM's FlashAttention
FLASH_INFER_AXES = ("block", "kv", "token", "head", "dim")  # earlier vLLM's FlashInfer
NAMES = {"token": "token", "head": "head", "dim": "dim", "content": "kv,dim"}  # in an arrangement


def pool_layout_of(
    caches: Sequence[Any], *, dtype: str, block_size: int, engine: str = "vllm", axes: Sequence[str] | None = None
) -> PoolLayout:
    """The layout of a pool held as ``caches``, one entry per layer: a tensor in one of the
    shapes above, or a ``(K, V)`` pair. ``axes`` names each dimension of a layer's tensor
    ("kv", "block", "token", "head", "dim", or "content" for a token's K then V) where it is
    not the shape's usual order (a 4-dimensional tensor is vLLM 0.32's; a 5-dimensional one
    FlashAttention's when its first dimension is 2, FlashInfer's otherwise). ValueError for
    anything else, or for layers that disagree or share memory."""
    if not caches:
        raise ValueError("no KV tensors to read a layout from")
    layers = [_layer(entry, block_size, axes) for entry in caches]
    first = layers[0]
    if any(layer.shape != first.shape for layer in layers):
        raise ValueError("the layers' KV tensors differ in shape or memory order")
    planes = [address for layer in layers for address in layer.planes]
    if len(set(planes)) != len(planes):
        raise ValueError("layers share KV memory (a hybrid model's groups): kvmesh moves one pool per layer")
    split = len(first.planes) == 2
    strided = _strided(layers, planes)
    if strided is not None:
        base, layer_stride, kv_stride, pool_bytes = strided
        listed: tuple[int, ...] = ()
    else:  # separate allocations: each plane named
        base, layer_stride, kv_stride, listed = min(planes), 0, 0, tuple(planes)
        pool_bytes = max(planes) + (first.num_blocks - 1) * first.block_stride + first.piece_bytes - base
    layout = PoolLayout(
        engine=engine, dtype=dtype, block_size=block_size, num_blocks=first.num_blocks, num_layers=len(layers),
        num_kv_heads=first.heads, head_dim=first.dim, layer_stride=layer_stride, block_stride=first.block_stride,
        arrangement=first.arrangement, base_address=base, pool_bytes=pool_bytes, kv_split=split, kv_stride=kv_stride,
        planes=listed,
    )  # fmt: skip
    if layout.piece_bytes != first.piece_bytes:
        raise ValueError(f"the KV tensors' elements are not {dtype} ({first.piece_bytes} bytes a piece, not {layout.piece_bytes})")
    return layout


@dataclass(slots=True, frozen=True)
class _Layer:
    block_stride: int  # bytes
    arrangement: str
    num_blocks: int
    heads: int
    dim: int
    piece_bytes: int
    planes: tuple[int, ...]  # block 0's piece: one (K and V together) or K's and V's
    storage: int  # the address of the storage it is a view of

    @property
    def shape(self) -> tuple[int, str, int, int, int, int, int]:
        return self.block_stride, self.arrangement, self.num_blocks, self.heads, self.dim, self.piece_bytes, len(self.planes)


def _axes(tensor: Any, paired: bool, axes: Sequence[str] | None) -> tuple[str, ...]:
    """What each dimension of a layer's tensor (or of each tensor of its pair) is."""
    if axes is not None:
        return tuple(axes)
    if paired:
        return PAIR_AXES
    if tensor.dim() == 5:
        return FLASH_ATTN_AXES if tensor.shape[0] == 2 else FLASH_INFER_AXES
    return PACKED_AXES


def _layer(entry: Any, block_size: int, axes: Sequence[str] | None) -> _Layer:
    if isinstance(entry, (tuple, list)):
        if len(entry) != 2 or entry[0].dim() != 4:
            raise ValueError("a layer's (K, V) pair must be two 4-dimensional tensors")
        names = _axes(entry[0], True, axes)
        return _pair(*(_viewed(t, names, PAIR_AXES, block_size) for t in entry))
    names = _axes(entry, False, axes)
    if entry.dim() == 4:
        return _packed(_viewed(entry, names, PACKED_AXES, block_size))
    if entry.dim() == 5:
        if sorted(names) != sorted(FLASH_ATTN_AXES) or entry.shape[names.index("kv")] != 2:
            raise ValueError(f"the KV tensor's dimensions {names} do not name K/V, blocks, tokens, heads and dim (shape {tuple(entry.shape)})")
        kv = names.index("kv")
        rest = names[:kv] + names[kv + 1 :]
        return _pair(*(_viewed(entry.select(kv, i), rest, PAIR_AXES, block_size) for i in (0, 1)))
    raise ValueError(f"kvmesh reads no KV layout from a tensor of shape {tuple(entry.shape)}")


def _viewed(tensor: Any, names: tuple[str, ...], order: tuple[str, ...], block_size: int) -> Any:
    """``tensor`` (dimensions named ``names``) viewed with its dimensions in ``order``."""
    if sorted(names) != sorted(order) or tensor.dim() != len(order):
        raise ValueError(f"the KV tensor's dimensions {names} are not {', '.join(order)} (shape {tuple(tensor.shape)})")
    view = tensor.permute(*(names.index(name) for name in order))
    tokens = view.shape[order.index("token")]
    if tokens != block_size:
        raise ValueError(f"the KV tensors hold blocks of {tokens} tokens, not {block_size}")
    return view


def _inside_a_block(view: Any, names: tuple[str, ...]) -> str:
    """The memory order of a block's dimensions (all but the first), outermost first, as an
    arrangement; ValueError unless they are dense (a block's piece one contiguous range)."""
    inner = sorted(range(1, view.dim()), key=lambda d: view.stride(d), reverse=True)
    expected = 1
    for d in reversed(inner):
        if view.stride(d) != expected and view.shape[d] > 1:
            raise ValueError(f"a block's KV is not one contiguous piece (shape {tuple(view.shape)}, strides {tuple(view.stride())})")
        expected *= view.shape[d]
    return ",".join(NAMES[names[d]] for d in inner)


def _packed(view: Any) -> _Layer:
    """vLLM 0.32's ``[blocks, heads, tokens, content]`` view: K and V together in a block."""
    num_blocks, heads, tokens, content = view.shape
    if content % 2:
        raise ValueError(f"a token's K and V take an even number of elements, not {content}")
    arrangement = _inside_a_block(view, PACKED_AXES)
    if view.device.type == "cpu" and arrangement == "head,token,kv,dim":
        arrangement = VLLM_CPU_ARRANGEMENT  # the CPU kernels keep a head's K for every token, then its V
    itemsize = view.element_size()
    return _Layer(
        view.stride(0) * itemsize, arrangement, num_blocks, heads, content // 2, heads * tokens * content * itemsize,
        (view.data_ptr(),), view.untyped_storage().data_ptr(),
    )  # fmt: skip


def _pair(k: Any, v: Any) -> _Layer:
    """One layer's K and V as ``[blocks, tokens, heads, dim]`` views: together when V is the
    piece after K (a ``kv,`` arrangement), apart otherwise."""
    if tuple(k.stride()) != tuple(v.stride()) or tuple(k.shape) != tuple(v.shape):
        raise ValueError("a layer's K and V tensors differ in shape or memory order")
    num_blocks, tokens, heads, dim = k.shape
    arrangement = _inside_a_block(k, PAIR_AXES)
    itemsize = k.element_size()
    piece, block_stride = tokens * heads * dim * itemsize, k.stride(0) * itemsize
    storage = k.untyped_storage().data_ptr()
    if v.data_ptr() == k.data_ptr() + piece and block_stride >= 2 * piece:
        return _Layer(block_stride, KV_FIRST + arrangement, num_blocks, heads, dim, 2 * piece, (k.data_ptr(),), storage)
    return _Layer(block_stride, arrangement, num_blocks, heads, dim, piece, (k.data_ptr(), v.data_ptr()), storage)


def _strided(layers: list[_Layer], planes: list[int]) -> tuple[int, int, int, int] | None:
    """(base, layer stride, K-to-V stride, pool bytes) where every layer is a view of one
    storage, evenly spaced (V after K); ``None`` where the planes must be listed."""
    storage = layers[0].storage
    if any(layer.storage != storage for layer in layers):
        return None
    parts = len(layers[0].planes)
    base = planes[0]
    last = max(planes) + (layers[0].num_blocks - 1) * layers[0].block_stride + layers[0].piece_bytes
    layer_stride = planes[parts] - base if len(layers) > 1 else last - base
    kv_stride = planes[1] - base if parts == 2 else 0
    if layer_stride <= 0 or (parts == 2 and kv_stride <= 0):
        return None
    for i, address in enumerate(planes):
        layer, part = divmod(i, parts)
        if address != base + layer * layer_stride + part * kv_stride:
            return None
    return base, layer_stride, kv_stride, last - base


def copy_blocks(caches: Sequence[Any], src: Sequence[int], dst: Sequence[int], *, axes: Sequence[str] | None = None) -> None:
    """Copy blocks ``src[i]`` to ``dst[i]`` in every layer of a pool held as ``caches`` (the
    shapes ``pool_layout_of`` reads), on the tensors' own device."""
    import torch

    indices: dict[Any, tuple[Any, Any]] = {}  # device -> (src, dst) index tensors there
    for entry in caches:
        paired = isinstance(entry, (tuple, list))
        for tensor in entry if paired else (entry,):
            if tensor.device not in indices:
                on = tensor.device
                indices[on] = (torch.tensor(list(src), dtype=torch.long, device=on), torch.tensor(list(dst), dtype=torch.long, device=on))
            frm, to = indices[tensor.device]
            axis = _axes(tensor, paired, axes).index("block")
            tensor.index_copy_(axis, to, tensor.index_select(axis, frm))
