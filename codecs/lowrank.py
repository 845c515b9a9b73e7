"""The `lowrank` medium: per layer, keys and values projected onto their top-r principal directions."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from kvbus.codecs._header import KVHeader
from kvbus.codecs._tensors import require_finite
from kvbus.codecs.base import register
from kvbus.codecs.errors import DecodeError, NonFiniteValues
from kvbus.codecs.layerwise import LayerBuffer, LayerwiseCodec
from kvbus.codecs.spec import Param
from kvbus.signature import ModelSignature

#: A payload may decode to at most this many times its own size (plus `MAX_EXPANSION_FLOOR`
#: bytes): hostile metadata (a tiny rank over a huge signature) must not make a receiver
#: allocate far more than it received.
MAX_EXPANSION = 256
MAX_EXPANSION_FLOOR = 1 << 20
#: Widest feature dimension (heads x head_dim) for the exact Gram-matrix basis; wider ones use
#: `randomized_bases`.
EXACT_MAX_DIM = 512


def effective_rank(rank: int, rows: int, dim: int) -> int:
    """The rank actually used: at most the number of token rows and the feature dimension."""
    return max(0, min(rank, rows, dim))


def principal_basis(x: torch.Tensor, r: int) -> torch.Tensor:
    """The top-``r`` right singular vectors of ``x`` ``[rows, dim]`` (float32), as ``[dim, r]``:
    the eigenvectors of the ``dim x dim`` Gram matrix (used when ``dim <= EXACT_MAX_DIM``; wider
    layers take `randomized_bases`)."""
    gram = x.T.double() @ x.double()
    require_finite("lowrank", ("the Gram matrix of a layer", gram))
    vecs: torch.Tensor = torch.linalg.eigh(gram)[1]
    return vecs[:, -r:].flip(1).float()


@functools.lru_cache(maxsize=16)
def _sketch(dim: int, r: int) -> torch.Tensor:
    """The Gaussian sketch ``[dim, r]`` of `randomized_bases`: from a generator seeded with 0, so
    that encoding is deterministic and leaves the global RNG alone (made once per shape; never
    written to)."""
    return torch.randn(dim, r, generator=torch.Generator().manual_seed(0))


#: `_orthonormal` takes Householder QR instead of Cholesky QR when the Cholesky factor's
#: diagonal spans more than this (a near rank-deficient block: a layer of zeros, fewer distinct
#: rows than the rank).
CHOLESKY_QR_MAX_SPREAD = 1e6


def _orthonormal(w: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the columns of each ``w [n, m, r]`` (float32), ``[n, m, r]``.

    Cholesky QR: ``w R^-1`` with ``R`` from the float64 Gram matrix (0.1-0.2 ms for ``[512, 64]``
    against 0.4-0.9 ms for Householder QR on 2 cores). Its orthogonality error grows with the
    condition number, so a block whose factor spans more than `CHOLESKY_QR_MAX_SPREAD` (or that
    holds NaN or inf, or is singular) takes Householder QR, which is orthonormal whatever the
    rank.
    """
    gram = w.transpose(1, 2).double() @ w.double()
    chol, info = torch.linalg.cholesky_ex(gram)
    d = chol.diagonal(dim1=1, dim2=2)
    if bool(info.any()) or not bool((d.amin(1) * CHOLESKY_QR_MAX_SPREAD > d.amax(1)).all()):
        q: torch.Tensor = torch.linalg.qr(w).Q
        return q
    q = torch.linalg.solve_triangular(chol.transpose(1, 2).float(), w, upper=True, left=False)
    return q


#: Columns of the sketch beyond the rank. Without them the range finder's error at a rank of 1-8
#: reached 1.4-1.9x the best (Eckart-Young) on decaying spectra; with 8, at most 1.09x at any rank
#: from 1 to 64 (rows 16-512, decays 0.3-2, three seeds each). At rank 64 they cost 1.46x the
#: time (a 72x72 eigendecomposition per tensor).
OVERSAMPLE = 8


def randomized_bases(x: torch.Tensor, r: int, names: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """An approximate top-``r`` right singular basis of each ``x [n, rows, dim]`` (float32), and the
    coefficients on it: ``([n, dim, r], [n, rows, r])``, principal direction first.

    Halko-Martinsson-Tropp's range finder without power iterations, `OVERSAMPLE` columns wide
    beyond ``r``: ``q``, an orthonormal basis of ``x`` times a Gaussian sketch (`_sketch`); ``v``,
    an orthonormal basis of ``x^T q`` (the row space of ``x`` projected on that range), whose
    coefficients ``x @ v`` are the best for it; then the top ``r`` of them (Rayleigh-Ritz: the
    eigenvectors of their small Gram matrix). Three products with ``x``, against five (and a
    Householder QR each) with the one power iteration it had before.

    Measured by `kvbus bench codecs` (Llama-3-8B shape, 512 tokens, bf16, r = 64, 2 cores): encode
    at 0.039x a ``copy_`` of the cache (0.015x before: one tensor at a time, a power iteration and
    Householder QR), 0.052x at 4096 tokens (0.020x); relative error 0.635 (0.621 before).

    Raises:
        NonFiniteValues: ``x[i]`` holds NaN or inf (``what`` is ``names[i]``): they reach its
            sketch, a ``[rows, r + OVERSAMPLE]`` product checked before anything else uses it.
    """
    k = min(r + OVERSAMPLE, x.shape[1], x.shape[2])
    sketched = x @ _sketch(x.shape[2], k)
    finite = torch.isfinite(sketched.sum(dim=(1, 2))).tolist()  # NaN and inf survive the sum
    if not all(finite):
        raise NonFiniteValues("lowrank", names[finite.index(False)])
    q = _orthonormal(sketched)
    v = _orthonormal(x.transpose(1, 2) @ q)
    coef = x @ v
    if v.shape[2] > r:
        top = torch.linalg.eigh((coef.transpose(1, 2) @ coef).double())[1][:, :, -r:].flip(2).float()
        v, coef = v @ top, coef @ top
    return v, coef


@register("lowrank")
class LowRankCodec(LayerwiseCodec):
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
        """A narrow layer's tensor (``heads x head_dim <= EXACT_MAX_DIM``): its coefficients and exact basis."""
        b, h, s, d = x.shape
        rows = x.permute(0, 2, 1, 3).reshape(b * s, h * d).float()
        r = effective_rank(self.args["rank"], b * s, h * d)
        if r == 0:
            return torch.empty((b * s, 0), dtype=x.dtype), torch.empty((0, h * d), dtype=x.dtype)
        basis = principal_basis(rows, r)
        return (rows @ basis).to(x.dtype), basis.T.contiguous().to(x.dtype)

    def _project_wide(self, keys: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
        """A wide layer's keys and values together (`randomized_bases` on both at once):
        ``[kcoef, kbasis, vcoef, vbasis]`` in float32, the bases as ``[r, features]``.

        Raises:
            NonFiniteValues: ``what`` is ``"keys"`` or ``"values"``.
        """
        b, h, s, d = keys.shape
        r = effective_rank(self.args["rank"], b * s, h * d)
        rows = torch.empty((2, b * s, h * d))
        for i, x in enumerate((keys, values)):  # the transpose and the conversion in one pass
            rows[i].view(b, s, h, d).copy_(x.permute(0, 2, 1, 3))
        if r == 0:
            return [torch.empty((b * s, 0)), torch.empty((0, h * d))] * 2
        basis, coef = randomized_bases(rows, r, ("keys", "values"))
        bases = basis.transpose(1, 2)
        return [coef[0], bases[0], coef[1], bases[1]]

    def _rank(self, header: KVHeader) -> int:
        b, h, s, d = header.layer_shape
        return effective_rank(self.args["rank"], b * s, h * d)

    def layer_layout(self, header: KVHeader) -> Sequence[LayerBuffer]:
        """Per tensor (keys, then values) ``coef [batch*seq, r]`` and ``basis [r, heads*head_dim]`` in the KV dtype."""
        b, h, s, d = header.layer_shape
        r = self._rank(header)
        coef = LayerBuffer("coefficients", header.dtype, (b * s, r))
        basis = LayerBuffer("basis", header.dtype, (r, h * d))
        return coef, basis, coef, basis

    def buffer_name(self, position: int, buffer: LayerBuffer, layer: int) -> str:
        """Errors count the layers' tensors: layer 3's value basis is ``basis[7]``."""
        return f"{buffer.what}[{2 * layer + position // 2}]"

    def encode_layer(
        self,
        header: KVHeader,
        keys: torch.Tensor,
        values: torch.Tensor,
        out: Sequence[torch.Tensor] | None = None,
    ) -> Sequence[torch.Tensor]:
        """The keys' coefficients and basis, then the values'.

        Raises:
            NonFiniteValues: ``keys`` or ``values`` hold NaN or inf (their Gram matrix or sketch is not finite).
        """
        _, h, _, d = keys.shape
        result: list[torch.Tensor] = []
        if h * d > EXACT_MAX_DIM:
            result = self._project_wide(keys, values)
            if not out:  # (with out, copy_ converts to the KV dtype in the same pass)
                result = [t.to(keys.dtype).contiguous() for t in result]
        else:
            for what, x in (("keys", keys), ("values", values)):
                try:
                    result += self._project(x)
                except NonFiniteValues:
                    raise NonFiniteValues(self.name, what) from None
        return [dst.copy_(t) for dst, t in zip(out, result, strict=True)] if out else result

    def check_payload(self, header: KVHeader, buffers: list[memoryview]) -> None:
        """Refuse a payload that would decode to far more than was received (see `MAX_EXPANSION`)."""
        b, h, s, d = header.layer_shape
        received = sum(buf.nbytes for buf in buffers)
        produced = 2 * header.n_layers * b * s * h * d * header.dtype.itemsize
        if produced > MAX_EXPANSION * received + MAX_EXPANSION_FLOOR:
            raise DecodeError(
                self.name,
                f"{received} bytes would decode to {produced} bytes, more than {MAX_EXPANSION}x what was received",
            )

    def decode_layer(
        self,
        header: KVHeader,
        views: list[torch.Tensor],
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Multiply coefficients by bases back to ``[batch, heads, seq, head_dim]`` in the KV dtype."""
        b, h, s, d = header.layer_shape
        r = self._rank(header)

        def rebuild(coef: torch.Tensor, basis: torch.Tensor, dst: torch.Tensor | None) -> torch.Tensor:
            rows = coef.float() @ basis.float() if r else torch.zeros(b * s, h * d)
            if dst is None:
                return rows.view(b, s, h, d).permute(0, 2, 1, 3).to(header.dtype).contiguous()
            # one pass: the transpose and the conversion to the KV dtype into dst
            dst.permute(0, 2, 1, 3).copy_(rows.view(b, s, h, d))
            return dst

        kc, kb, vc, vb = views
        ko, vo = out if out else (None, None)
        return rebuild(kc, kb, ko), rebuild(vc, vb, vo)

    def estimate_nbytes(self, signature: ModelSignature, n_tokens: int, batch: int = 1) -> int:
        """Token ids plus, per layer and tensor, ``rows x r`` coefficients and an ``r x features`` basis."""
        hd = signature.n_kv_heads * signature.head_dim
        rows = batch * n_tokens
        r = effective_rank(self.args["rank"], rows, hd)
        per_tensor = (rows * r + r * hd) * signature.torch_dtype.itemsize
        return rows * 8 + 2 * signature.n_layers * per_tensor
