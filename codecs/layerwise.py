"""`LayerwiseCodec`: the family of dense KV media that encode and decode one layer at a time.

``full``, ``int8``, ``int4`` and ``lowrank`` send the same frame: the `KVHeader` as metadata,
the token ids (and KV positions) first, then a few tensors per layer. They differ only in what
a layer becomes (`encode_layer`), what its buffers must look like (`layer_layout`) and how a
layer is rebuilt from them (`decode_layer`); this base does the rest, with every buffer of every
layer checked (views, no allocation) before anything is computed from one.
"""

from __future__ import annotations

import collections
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbus.codecs._arena import carve, carve_arena
from kvbus.codecs._header import KVHeader, encode_buffers
from kvbus.codecs._tensors import check_buffer_count, require_map, tensors_from
from kvbus.codecs.base import Codec, Encoded, ModelRunner
from kvbus.codecs.errors import NonFiniteValues
from kvbus.kvcache import KVCache


@dataclass(frozen=True, slots=True)
class LayerBuffer:
    """What one buffer of every layer must hold, and where it travels."""

    what: str
    """What it is, for errors: ``"keys"`` names layer 3's ``keys[3]`` (see `LayerwiseCodec.buffer_name`)."""
    dtype: torch.dtype
    """The dtype of its elements."""
    shape: tuple[int, ...]
    """The shape of the tensor it holds."""
    section: int = 0
    """The section of the payload it travels in (see `LayerwiseCodec`)."""


class LayerwiseCodec(Codec):
    """A KV medium whose payload is the tokens (and positions), then per layer a few tensors.

    Wire layout: ``[tokens int64, (positions int64), section 0, section 1, ...]``, where section
    ``j`` holds, layer after layer, that layer's buffers whose `LayerBuffer.section` is ``j`` (in
    the order `layer_layout` lists them). Media with tensors of several dtypes use sections to
    keep every buffer aligned to its dtype (``int8`` sends all its scales, then all its codes).

    Subclasses implement `layer_layout` (the one description of the wire layout, used on both
    ends), `encode_layer` and `decode_layer`; `check_payload` adds whole-payload checks and
    `buffer_name` other names in errors. A decoded cache's fidelity is the sender's times this
    medium's (1 for a lossless one).

    Outputs: with `encode_arena` (`decode_arena`), `encode` (`decode`) makes one arena for every
    layer's outputs (`kvbus.codecs._arena`: views of one block, in wire order for an encode) and
    hands each layer its views as ``out``; an arena nothing references any more is reused by a
    later call of about its size, so a repeated transfer does not fault fresh pages in.
    """

    encode_arena: ClassVar[bool] = True
    """Whether `encode` hands `encode_layer` arena views to write the layer's buffers into."""
    decode_arena: ClassVar[bool] = True
    """Whether `decode` hands `decode_layer` arena views to write the layer's keys and values into."""

    @abstractmethod
    def layer_layout(self, header: KVHeader) -> Sequence[LayerBuffer]:
        """The buffers of each layer, in the order `encode_layer` returns and `decode_layer` takes them.

        A decoder checks them in this order. Called once per payload, for a header that has
        already been checked.
        """

    @abstractmethod
    def encode_layer(
        self,
        header: KVHeader,
        keys: torch.Tensor,
        values: torch.Tensor,
        out: Sequence[torch.Tensor] | None = None,
    ) -> Sequence[torch.Tensor]:
        """One layer's tensors, one per buffer of `layer_layout`, in that order.

        ``keys`` and ``values`` are ``[batch, kv_heads, seq, head_dim]`` and must not be modified.
        ``out`` (with `encode_arena`): contiguous tensors of the layout's dtypes and shapes
        (contents undefined) to write the results into and return; a result returned elsewhere
        is sent as it is.
        """

    @abstractmethod
    def decode_layer(
        self,
        header: KVHeader,
        views: list[torch.Tensor],
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rebuild one layer's ``(keys, values)`` from the checked views of its buffers (layout order).

        The views alias the received payload: build new tensors rather than write into them.
        ``out`` (with `decode_arena`): two contiguous ``[batch, kv_heads, seq, head_dim]`` tensors
        in the KV dtype (contents undefined) to write the keys and values into and return.
        """

    def check_payload(self, header: KVHeader, buffers: list[memoryview]) -> None:
        """Checks over every layer's buffers at once, before any is viewed (default: none).

        Raises:
            DecodeError: the payload is unacceptable as a whole.
        """

    def buffer_name(self, position: int, buffer: LayerBuffer, layer: int) -> str:
        """How errors name buffer ``position`` of the layout of layer ``layer`` (default ``"keys[3]"``)."""
        return f"{buffer.what}[{layer}]"

    def encode(self, kv: KVCache, *, base: KVCache | None = None, runner: ModelRunner | None = None) -> Encoded:
        """Encode ``kv`` layer by layer (its tensors are not modified).

        Raises:
            SignatureMismatch: ``kv`` does not fit its own signature.
            NonFiniteValues: a lossy medium was given NaN or inf (``what`` names the layer).
        """
        header = KVHeader.of(kv)
        tensors = header.prefix_tensors(kv)
        if kv.keys:
            layout = self.layer_layout(header)
            sections: dict[int, list[torch.Tensor]] = {j: [] for j in sorted({want.section for want in layout})}
            outs = self._encode_outputs(layout, len(kv.keys)) if self.encode_arena else None

            for i, (k, v) in enumerate(zip(kv.keys, kv.values)):
                try:
                    layer = self.encode_layer(header, k, v, outs[i] if outs else None)
                except NonFiniteValues as exc:
                    raise NonFiniteValues(self.name, f"{exc.what}[{i}]") from None
                for want, tensor in zip(layout, layer, strict=True):
                    sections[want.section].append(tensor)
            for section in sections.values():
                tensors += section
        return Encoded(codec=self.name, meta=header.to_meta(), buffers=encode_buffers(tensors), keepalive=tensors)

    def decode(self, encoded: Encoded, *, base: KVCache | None = None, runner: ModelRunner | None = None) -> KVCache:
        """Rebuild the cache; the result's fidelity is the sender's times this medium's.

        Raises:
            DecodeError: the metadata or a buffer is malformed.
        """
        header = KVHeader.from_meta(require_map(encoded.meta, self.name), self.name)
        n = header.n_layers
        layout = self.layer_layout(header) if n else ()
        first, stride = _wire_index(layout, n)
        buffers = check_buffer_count(encoded.buffers, header.n_prefix + n * len(layout), self.name)
        tokens, positions = header.read_prefix(buffers, self.name)
        layers = buffers[header.n_prefix :]
        self.check_payload(header, layers)
        # Every buffer is checked (views, no allocation) before anything is computed from one.
        region, offsets = encoded.region, encoded.offsets
        if len(offsets) != len(buffers):
            region = None
        # Buffer p of every layer, by slicing (what a comprehension per layer costs adds up).
        wire = [slice(first[p], first[p] + n * stride[p], stride[p]) for p in range(len(layout))]
        by_position = [
            tensors_from(
                layers[at],
                want.dtype,
                want.shape,
                self.name,
                lambda i, p=p, want=want: self.buffer_name(p, want, i),  # type: ignore[misc]
                region=region,
                offsets=offsets[header.n_prefix :][at] if region else (),
            )
            for p, (want, at) in enumerate(zip(layout, wire))
        ]
        keys, values = [], []
        outs = carve([(header.dtype, header.layer_shape)] * (2 * n)) if self.decode_arena and n else None

        for i, views in enumerate(zip(*by_position)):
            out = (outs[2 * i], outs[2 * i + 1]) if outs else None
            k, v = self.decode_layer(header, list(views), out)
            keys.append(k)
            values.append(v)
        kv = KVCache(
            tokens=tokens,
            signature=header.signature,
            keys=keys,
            values=values,
            positions=positions,
            fidelity=header.fidelity * self.fidelity if n else header.fidelity,
        )
        return header.finish(kv, self.name)

    def _encode_outputs(self, layout: Sequence[LayerBuffer], n_layers: int) -> list[list[torch.Tensor]]:
        """Per layer, views of one arena for its buffers (layout order), laid out in wire order."""
        first, stride = _wire_index(layout, n_layers)
        order = sorted((first[p] + i * stride[p], i, p) for i in range(n_layers) for p in range(len(layout)))
        views, _ = carve_arena([(layout[p].dtype, layout[p].shape) for _, _, p in order])
        by_place = {(i, p): view for view, (_, i, p) in zip(views, order)}
        return [[by_place[i, p] for p in range(len(layout))] for i in range(n_layers)]


def _wire_index(layout: Sequence[LayerBuffer], n_layers: int) -> tuple[list[int], list[int]]:
    """Where the buffers of ``layout`` travel: buffer ``p`` of layer ``i`` is number ``first[p] + i * stride[p]``
    after the tokens and positions."""
    widths = collections.Counter(want.section for want in layout)
    starts: dict[int, int] = {}
    offset = 0
    for section in sorted(widths):
        starts[section] = offset
        offset += n_layers * widths[section]
    first: list[int] = []
    stride: list[int] = []
    seen: collections.Counter[int] = collections.Counter()
    for want in layout:
        first.append(starts[want.section] + seen[want.section])
        stride.append(widths[want.section])
        seen[want.section] += 1
    return first, stride
