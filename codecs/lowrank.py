"""The `lowrank` medium: per layer, keys and values projected onto their top-r principal directions."""

from __future__ import annotations

import torch

from kvbus.codecs._header import KVHeader, encode_buffers
from kvbus.codecs._tensors import check_buffer_count, require_map, tensor_from
from kvbus.codecs.base import Codec, Encoded, ModelRunner, register
from kvbus.codecs.errors import DecodeError
from kvbus.codecs.spec import Param
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

#: A payload may decode to at most this many times its own size (plus `MAX_EXPANSION_FLOOR`
#: bytes): hostile metadata (a tiny rank over a huge signature) must not make a receiver
#: allocate far more than it received.
MAX_EXPANSION = 256
MAX_EXPANSION_FLOOR = 1 << 20
#: Widest feature dimension (heads x head_dim) for the exact Gram-matrix basis; wider ones use
#: `torch.svd_lowrank`.
EXACT_MAX_DIM = 512


def effective_rank(rank: int, rows: int, dim: int) -> int:
    """The rank actually used: at most the number of token rows and the feature dimension."""
    return max(0, min(rank, rows, dim))


def principal_basis(x: torch.Tensor, r: int) -> torch.Tensor:
    """The top-``r`` right singular vectors of ``x`` ``[rows, dim]`` (float32), as ``[dim, r]``.

    Exact (eigenvectors of the ``dim x dim`` Gram matrix) when ``dim <= EXACT_MAX_DIM``, else
    randomised (`torch.svd_lowrank`, two power iterations, under a fixed seed so that encoding
    is deterministic and leaves the global RNG alone).
    """
    if x.shape[1] <= EXACT_MAX_DIM:
        gram = x.T.double() @ x.double()
        _, vecs = torch.linalg.eigh(gram)
        return vecs[:, -r:].flip(1).float()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        _, _, v = torch.svd_lowrank(x, q=r, niter=2)
    return v[:, :r]


@register("lowrank")
class LowRankCodec(Codec):
    """Each layer's keys and values, as token rows of ``heads x head_dim`` features, projected to rank ``r``.

    The basis is computed per transfer and per tensor (exactly for narrow models, randomised
    for wide ones) and travels with the coefficients: ``coef [batch*seq, r]`` and
    ``basis [r, heads*head_dim]``, both in the KV dtype. It compresses when ``r`` is well below
    ``heads x head_dim`` (SmolLM2: 192; Llama-3-8B: 1024) and the cache is longer than that.

    Spec: ``lowrank`` or ``lowrank(r)`` / ``lowrank(rank=32)``.

    Wire layout: ``[tokens, (positions), kcoef0, kbasis0, vcoef0, vbasis0, ...]``.
    """

    params = (Param("rank", int, 64, lo=1, hi=1 << 16),)
    lossless = False
    fidelity = 0.6

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, s, d = x.shape
        rows = x.permute(0, 2, 1, 3).reshape(b * s, h * d).float()
        r = effective_rank(self.args["rank"], b * s, h * d)
        if r == 0:
            return torch.empty((b * s, 0), dtype=x.dtype), torch.empty((0, h * d), dtype=x.dtype)
        basis = principal_basis(rows, r)
        return (rows @ basis).to(x.dtype), basis.T.contiguous().to(x.dtype)

    def encode(self, kv: KVCache, *, base: KVCache | None = None, runner: ModelRunner | None = None) -> Encoded:
        """Project every layer's keys and values (its tensors are not modified).

        Raises:
            SignatureMismatch: ``kv`` does not fit its own signature.
        """
        header = KVHeader.of(kv)
        tensors = header.prefix_tensors(kv)
        for k, v in zip(kv.keys, kv.values):
            tensors += [*self._project(k), *self._project(v)]
        return Encoded(codec=self.name, meta=header.to_meta(), buffers=encode_buffers(tensors), keepalive=tensors)

    def decode(self, encoded: Encoded, *, base: KVCache | None = None,
               runner: ModelRunner | None = None) -> KVCache:
        """Multiply coefficients by bases back to ``[batch, heads, seq, head_dim]`` in the KV dtype.

        Raises:
            DecodeError: the metadata or a buffer is malformed.
        """
        header = KVHeader.from_meta(require_map(encoded.meta, self.name), self.name)
        n = header.n_layers
        buffers = check_buffer_count(encoded.buffers, header.n_prefix + 4 * n, self.name)
        tokens, positions = header.read_prefix(buffers, self.name)
        b, h, s, d = header.layer_shape
        r = effective_rank(self.args["rank"], b * s, h * d)
        layers = buffers[header.n_prefix:]
        received = sum(buf.nbytes for buf in layers)
        produced = 2 * n * b * s * h * d * header.dtype.itemsize
        if produced > MAX_EXPANSION * received + MAX_EXPANSION_FLOOR:
            raise DecodeError(self.name, f"{received} bytes would decode to {produced} bytes, more than "
                                         f"{MAX_EXPANSION}x what was received")
        views = [(tensor_from(layers[2 * i], header.dtype, (b * s, r), self.name, f"coefficients[{i}]"),
                  tensor_from(layers[2 * i + 1], header.dtype, (r, h * d), self.name, f"basis[{i}]"))
                 for i in range(2 * n)]

        def rebuild(coef: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
            rows = coef.float() @ basis.float() if r else torch.zeros(b * s, h * d)
            return rows.view(b, s, h, d).permute(0, 2, 1, 3).to(header.dtype).contiguous()

        keys = [rebuild(*views[2 * i]) for i in range(n)]
        values = [rebuild(*views[2 * i + 1]) for i in range(n)]
        kv = KVCache(tokens=tokens, signature=header.signature, keys=keys, values=values,
                     positions=positions, fidelity=header.fidelity * self.fidelity if n else header.fidelity)
        return header.finish(kv, self.name)

    def estimate_nbytes(self, signature: ModelSignature, n_tokens: int, batch: int = 1) -> int:
        """Token ids plus, per layer and tensor, ``rows x r`` coefficients and an ``r x features`` basis."""
        hd = signature.n_kv_heads * signature.head_dim
        rows = batch * n_tokens
        r = effective_rank(self.args["rank"], rows, hd)
        per_tensor = (rows * r + r * hd) * signature.torch_dtype.itemsize
        return rows * 8 + 2 * signature.n_layers * per_tensor
