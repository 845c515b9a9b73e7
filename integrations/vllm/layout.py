"""Block layout: vLLM's paged KV tensors <-> `KVCache` tensors ``[1, kv_heads, seq, head_dim]``.

vLLM's CPU attention backend keeps one tensor per layer, ``[num_blocks, kv_heads, block_size,
2 * head_dim]``; inside a (block, head) the first ``block_size * head_dim`` values are the keys
and the rest the values, each in the kernel's own order (on x86 the keys are stored transposed,
``[head_dim, block_size]``; the values as ``[block_size, head_dim]``). Rather than hard-code
that order, `PagedLayout.probe` asks the kernel: it writes numbered keys and values with the
kernel's own cache writer into a scratch block and records where each one landed. Reads gather
with that map; writes go through the kernel's writer (so whatever it does, quantisation scales
included, it does to loaded blocks too). The probe is checked by a round trip of random data
before the layout is used: a kernel this code cannot read is refused, never guessed at.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvbus.errors import KVBusError

#: ``writer(key [T, h, d], value [T, h, d], key_cache, value_cache, slot_mapping [T])``: the
#: kernel's cache writer; ``key_cache`` and ``value_cache`` are the two halves of a layer tensor
#: viewed as ``[num_blocks, h, 2 * block_size, d]`` and split on dim 2.
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class LayoutError(KVBusError):
    """The engine's paged KV tensors are not in a layout this connector can read and write.

    Attributes:
        reason: what did not fit.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"unsupported paged KV layout: {reason}")


def _halves(layer: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, h, _, _ = layer.shape
    view = layer.view(n, h, 2 * block_size, -1)
    k, v = view.chunk(2, dim=2)
    return k, v


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """Where each key and value of a block sits in one layer's paged tensor (the same for every layer)."""

    block_size: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    k_index: torch.Tensor
    """int64 ``[block_size * head_dim]``: offset, in a head's key half of a block, of key ``[t, j]``
    at ``t * d + j``."""
    v_index: torch.Tensor
    """The same for the values (offsets in the value half)."""
    writer: CacheWriter | None = None
    """The kernel's writer; None writes by the probed offsets."""

    @classmethod
    def probe(
        cls, *, block_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, writer: CacheWriter | None
    ) -> PagedLayout:
        """Learn the kernel's block interior from ``writer`` (None: keys and values ``[block_size, head_dim]``).

        Raises:
            LayoutError: the writer's placement is not a permutation of the block, differs between
                heads, or a round trip of random data does not come back bit for bit.
        """
        bs, h, d = block_size, n_kv_heads, head_dim
        if writer is None:
            plain = torch.arange(bs * d, dtype=torch.int64)
            return cls(bs, h, d, dtype, plain, plain.clone(), None)
        # Numbers up to bs * d are exact in float32 and in half precision up to 2048; use float32
        # for the probe (the layout depends on the element size only through the kernel's ISA,
        # which the caller chose for the engine's dtype).
        codes = torch.arange(1, bs * d + 1, dtype=torch.float32).reshape(bs, 1, d).expand(bs, h, d).contiguous()
        scratch = torch.zeros(1, h, bs, 2 * d, dtype=torch.float32)
        kc, vc = _halves(scratch, bs)
        writer(codes, -codes, kc, vc, torch.arange(bs, dtype=torch.int64))
        flat = scratch.reshape(h, 2 * bs * d)
        indices = []
        for half, sign in ((flat[:, : bs * d], 1.0), (flat[:, bs * d :], -1.0)):
            got = (half * sign).round().to(torch.int64)
            if not torch.equal(got, got[:1].expand_as(got)):
                raise LayoutError("the kernel orders the heads of a block differently")
            row = got[0]
            if sorted(row.tolist()) != list(range(1, bs * d + 1)):
                raise LayoutError("the kernel's writer does not fill a block with a permutation of its inputs")
            index = torch.empty(bs * d, dtype=torch.int64)
            index[row - 1] = torch.arange(bs * d, dtype=torch.int64)
            indices.append(index)
        layout = cls(bs, h, d, dtype, indices[0], indices[1], writer)
        layout._check_round_trip()
        return layout

    def _check_round_trip(self) -> None:
        gen = torch.Generator().manual_seed(0)
        n = 2
        layer = torch.zeros(n + 1, self.n_kv_heads, self.block_size, 2 * self.head_dim, dtype=self.dtype)
        keys = torch.randn(1, self.n_kv_heads, n * self.block_size, self.head_dim, generator=gen).to(self.dtype)
        values = torch.randn(1, self.n_kv_heads, n * self.block_size, self.head_dim, generator=gen).to(self.dtype)
        self.write(layer, [2, 0], keys, values)
        k, v = self.read(layer, [2, 0])
        if not (torch.equal(k, keys) and torch.equal(v, values)):
            raise LayoutError("a round trip through the kernel's writer and the probed offsets changed the data")

    def fingerprint(self) -> str:
        """A short id of the interior order (equal fingerprints: blocks can be copied byte for byte)."""
        h = hashlib.blake2b(digest_size=6)
        h.update(f"{self.block_size}|{self.n_kv_heads}|{self.head_dim}|{self.dtype}".encode())
        h.update(self.k_index.numpy().tobytes())
        h.update(self.v_index.numpy().tobytes())
        return h.hexdigest()

    def check(self, layer: torch.Tensor) -> None:
        """Raise `LayoutError` unless ``layer`` is a paged tensor of this layout."""
        want = (self.n_kv_heads, self.block_size, 2 * self.head_dim)
        if layer.dim() != 4 or tuple(layer.shape[1:]) != want:
            raise LayoutError(
                f"expected a layer tensor [num_blocks, {want[0]}, {want[1]}, {want[2]}], got {list(layer.shape)}"
            )
        if not layer.is_contiguous():
            raise LayoutError("the layer tensor is not contiguous")
        if layer.dtype != self.dtype:
            raise LayoutError(f"expected KV in {self.dtype}, got {layer.dtype}")

    def read(self, layer: torch.Tensor, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``block_ids`` in order, as new ``[1, h, len(block_ids) * block_size, d]`` tensors."""
        bs, h, d = self.block_size, self.n_kv_heads, self.head_dim
        n = len(block_ids)
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        flat = layer.index_select(0, ids).reshape(n, h, 2 * bs * d)
        k = flat[..., : bs * d].index_select(-1, self.k_index).reshape(n, h, bs, d)
        v = flat[..., bs * d :].index_select(-1, self.v_index).reshape(n, h, bs, d)
        k = k.permute(1, 0, 2, 3).reshape(1, h, n * bs, d)
        v = v.permute(1, 0, 2, 3).reshape(1, h, n * bs, d)
        return k, v

    def write(self, layer: torch.Tensor, block_ids: Sequence[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``keys``/``values`` ``[1, h, len(block_ids) * block_size, d]`` into ``block_ids`` of ``layer``."""
        bs, h, d = self.block_size, self.n_kv_heads, self.head_dim
        n = len(block_ids)
        if tuple(keys.shape) != (1, h, n * bs, d) or tuple(values.shape) != (1, h, n * bs, d):
            raise LayoutError(
                f"expected keys and values [1, {h}, {n * bs}, {d}], got {list(keys.shape)} / {list(values.shape)}"
            )
        keys = keys.to(layer.dtype)
        values = values.to(layer.dtype)
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        if self.writer is not None:
            slots = (ids.reshape(n, 1) * bs + torch.arange(bs, dtype=torch.int64).reshape(1, bs)).reshape(-1)
            kc, vc = _halves(layer, bs)
            self.writer(keys[0].permute(1, 0, 2).contiguous(), values[0].permute(1, 0, 2).contiguous(), kc, vc, slots)
            return
        k = keys[0].reshape(h, n, bs * d).permute(1, 0, 2)
        v = values[0].reshape(h, n, bs * d).permute(1, 0, 2)
        flat = torch.empty(n, h, 2 * bs * d, dtype=layer.dtype)
        flat[..., : bs * d].index_copy_(-1, self.k_index, k.contiguous())
        flat[..., bs * d :].index_copy_(-1, self.v_index, v.contiguous())
        layer.index_copy_(0, ids, flat.reshape(n, h, bs, 2 * d))
