"""A fitted transform code for boundary residuals: fewer than one bit per coordinate where the residual has
preferred directions (``mask.reference_code_bits``).

The rotated codec (:mod:`.rotquant`) makes every coordinate equally important with a random rotation, so its
cheapest code is one bit for each of the H coordinates; dropping coordinates costs more than it saves. What
fine-tuning changes at a stage boundary (the reference residual, :mod:`meshnode.stage.reference`) is not
isotropic: on SmolLM2-135M after 30-60 dense steps the top 64 of 576 directions of its per-token normalised
second moment hold about half its energy and the top 288 about 80 % (``scripts/probe_transform_coding.py``).
A Karhunen-Loeve transform fitted by the sender, with the bits given where the variance is, then spends a
budget of R bits per token far better than a rotation can:

1. **Fit** (sender, every few steps, from the statistics of the residuals it has coded): the eigenvectors and
   eigenvalues ``var_i`` of ``S = mean_t(e_t e_t^T / rms(e_t)^2)`` (trace H: each token counted by its
   direction, so the attention sink's huge vector does not own the basis). Integer bits ``b_i`` in 0..4 by
   greedy reverse water-filling: each of the R bits goes where it removes the most expected squared error,
   ``var_i (D(b) - D(b + 1))`` with ``D`` the unit Gaussian's quantiser error at b bits; those gains fall with
   b, so the greedy choice is the top R of the (direction, bit) gains, computed at once. The directions with
   ``b_i > 0`` (m of them) and their scales ``sqrt(var_i)`` and bits travel once per fit: ``m (2 H + 5)`` bytes.
2. **Code** each token: ``c = E^T e / rms(e)``; direction i quantised with the MSE-optimal uniform ``b_i``-bit
   quantiser of a Gaussian of std ``sqrt(var_i)`` (Max 1960); the codes of a token are packed as one bit
   string (``R`` bits: ``ceil(R / 8)`` bytes) plus its rms as a float32.
3. **Decode**: ``e_hat = rms * E c_hat``; the directions without bits decode to 0.

Everything here is pure tensor code; the sender's statistics and the shipping of a fit live with the residual
map (:class:`meshnode.stage.reference.ResidualMap`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .rotquant import pack_codes, unpack_codes

MAX_CODE_BITS = 4  # per direction
# the MSE-optimal uniform quantiser step for a unit Gaussian with 2**b levels, and its mean squared error
# (Max 1960, Table I), for b = 0..4
TC_STEP = (0.0, 1.5956, 0.9957, 0.5860, 0.3352)
TC_MSE = (1.0, 0.3634, 0.1188, 0.03744, 0.01154)
BASIS_DTYPE = torch.bfloat16
BASIS_DTYPES = (torch.bfloat16, torch.float32)  # as it travels in bfloat16, or decoded from 8 bits per column
METRIC_FLOOR = 0.01  # a Fisher metric (trace H) plus this x I: no direction is weighted below a tenth in amplitude
# the largest coefficient scale a receiver takes, in units of sqrt(H): 1 for an orthonormal basis (the variances sum
# to H); a Fisher-weighted code's basis is not orthogonal and its coefficients can exceed the vector's norm
MAX_SCALE = {False: 1.01, True: 32.0}


@dataclass(frozen=True)
class Transform:
    """A fitted transform code: ``basis`` (H, m) in bfloat16 (orthonormal columns, as rounded for the wire; or
    float32, as decoded from 8 bits per value), ``scale`` (m,) float32 (each direction's std in the
    normalised units), ``bits`` (m,) uint8 in 1..4.

    ``encoder`` (H, m) float32, the sender's only (it never travels): the projection that gives the coefficients when
    they are not ``basis``' (a Fisher-weighted code, :func:`fit_transform`'s ``metric``, or one fitted to its basis as
    rounded for the wire, ``round_basis``); None: ``basis``."""

    basis: Tensor
    scale: Tensor
    bits: Tensor
    encoder: Tensor | None = field(default=None, compare=False)

    @property
    def coder(self) -> Tensor:
        """The projection that gives the coefficients: ``encoder`` where the sender has one, else ``basis``."""
        return self.basis if self.encoder is None else self.encoder

    @property
    def code_bits(self) -> int:
        """Bits per token of the packed codes."""
        return int(self.bits.to(torch.int64).sum())

    @property
    def code_bytes(self) -> int:
        return (self.code_bits + 7) // 8

    def check(self, hidden: int, weighted: bool = False) -> None:
        """Raise ValueError unless this is a well-formed transform for ``hidden`` channels (a peer's payload);
        ``weighted``: a Fisher-weighted code's (unit but not orthogonal columns, larger scales)."""
        if self.basis.dim() != 2 or self.basis.shape[0] != hidden or not 1 <= self.basis.shape[1] <= hidden:
            raise ValueError(f"transform basis must be ({hidden}, m) with 1 <= m <= {hidden}, got "
                             f"{tuple(self.basis.shape)}")
        m = self.basis.shape[1]
        for name, t, dts in (("basis", self.basis, BASIS_DTYPES), ("scale", self.scale, (torch.float32,)),
                             ("bits", self.bits, (torch.uint8,))):
            if t.dtype not in dts:
                raise ValueError(f"transform {name} must be {' or '.join(map(str, dts))}, got {t.dtype}")
            if name != "basis" and tuple(t.shape) != (m,):
                raise ValueError(f"transform {name} must have shape ({m},), got {tuple(t.shape)}")
        if not (bool(torch.isfinite(self.basis.float()).all()) and bool(torch.isfinite(self.scale).all())):
            raise ValueError("transform has non-finite values")
        top = MAX_SCALE[weighted]
        if bool((self.scale <= 0).any()) or bool((self.scale > top * hidden ** 0.5).any()):
            raise ValueError(f"transform scales must be in (0, {top:g} sqrt({hidden})]")
        norms = self.basis.float().norm(dim=0)
        if bool(((norms - 1).abs() > 0.02).any()):
            raise ValueError("transform basis columns must have unit norm")
        if bool(((self.bits < 1) | (self.bits > MAX_CODE_BITS)).any()):
            raise ValueError(f"transform bits must be in 1..{MAX_CODE_BITS}")


def allocate_bits(var: Tensor, budget: int) -> Tensor:
    """Integer bits (0..4) per direction for directions of variance ``var`` (n,), ``budget`` bits in all (at most
    4 n): the top ``budget`` of the gains ``var_i (D(b) - D(b + 1))``, which fall with b for every i."""
    n = var.shape[0]
    if not 0 <= budget <= MAX_CODE_BITS * n:
        raise ValueError(f"code budget must be in [0, {MAX_CODE_BITS * n}] bits, got {budget}")
    d = torch.tensor(TC_MSE, dtype=torch.float64)
    gains = var.double().clamp_min(0)[:, None] * (d[:-1] - d[1:])[None, :]  # (n, 4), falling along dim 1
    top = torch.topk(gains.reshape(-1), budget).indices
    bits = torch.zeros(n * MAX_CODE_BITS, dtype=torch.int64)
    bits[top] = 1
    return bits.reshape(n, MAX_CODE_BITS).sum(1)


def fit_transform(second_moment: Tensor, budget: int, basis_dtype: torch.dtype = BASIS_DTYPE,
                  metric: Tensor | None = None, round_basis: Callable[[Tensor], Tensor] | None = None) -> Transform:
    """The transform code of ``budget`` bits per token for vectors whose per-token normalised second moment is
    ``second_moment`` (H, H); its trace is taken as H (rescaled if not). The basis is rounded to ``basis_dtype``
    (float32 for a caller that quantises it further).

    ``metric`` (H, H), positive semi-definite (the empirical Fisher of the coded vectors, ``sum g g^T`` of the
    loss's gradients with respect to them): minimise the error weighted by it instead, ``(e - e_hat)^T M (e -
    e_hat)``. With ``L = M^(1/2)`` (M scaled to trace H, plus :data:`METRIC_FLOOR` x I), the code is the KLT of
    ``L e``: coefficients ``c = (L b_i)^T e`` for the eigenvectors ``b_i`` of ``L S L``, decoded along ``L^-1 b_i``.
    Those directions travel as unit columns (the basis), each one's norm folded into its scale, and ``encoder``
    holds ``L b_i`` times the same norms: the receiver decodes exactly as for a plain code.

    ``round_basis``: rounds the unit basis (float32) as it will travel (to bfloat16, or to 8 or 4 bits per value;
    it returns what both ends decode with, which becomes ``basis``). The sender's encoder is then fitted to the
    rounded directions ``D``, not to the exact ones: ``E = M D (D^T M D)^-1`` (``M = I`` for a plain code; directions
    rounding made collinear are coded by their common part, :func:`_collinear_pinv`), the coefficients that
    minimise the (weighted) error of ``D c``, and the scales are those coefficients' spreads. For
    the exact ``D`` this is the encoder above; for a coarsely rounded one (4 bits) it undoes what the rounding moved
    the directions by (their overlaps) instead of coding against directions the receiver does not use."""
    s = second_moment.double()
    h = s.shape[0]
    if s.shape != (h, h):
        raise ValueError(f"second moment must be square, got {tuple(s.shape)}")
    if not 1 <= budget <= MAX_CODE_BITS * h:
        raise ValueError(f"code budget must be in [1, {MAX_CODE_BITS * h}] bits, got {budget}")
    s = (s + s.T) / 2
    tr = float(s.trace())
    if not tr > 0 or not bool(torch.isfinite(s).all()):
        raise ValueError("second moment must be finite with a positive trace")
    s = s * (h / tr)
    plain = s
    root = None
    if metric is not None:
        root, inv = metric_root(metric)
        s = root @ s @ root
    var, vecs = torch.linalg.eigh((s + s.T) / 2)
    order = torch.argsort(var, descending=True)
    var, vecs = var[order].clamp_min(0), vecs[:, order]
    bits = allocate_bits(var, budget)
    keep = bits > 0
    floor = 1e-12 * float(var[0])
    scale = var[keep].clamp_min(floor).sqrt()
    if root is None:
        basis, encoder = vecs[:, keep], None
    else:
        dec = inv @ vecs[:, keep]  # the directions the coefficients decode along
        norms = dec.norm(dim=0)
        basis, scale, encoder = dec / norms, scale * norms, (root @ vecs[:, keep]) * norms
    bits = bits[keep].to(torch.uint8)
    if round_basis is None:
        return Transform(basis=basis.to(basis_dtype), scale=scale.float(), bits=bits,
                         encoder=None if encoder is None else encoder.float())
    rounded = round_basis(basis.float())
    d = rounded.double()
    md = d if root is None else (root @ root) @ d
    encoder = md @ _collinear_pinv(d.T @ md)  # M D (D^T M D)^-1
    # the std of each coefficient E^T e, within what a receiver takes (a near-orthogonal plain code's can pass
    # sqrt(H) by a hair when one direction holds nearly all the variance; the quantiser clips the rare excess)
    spread = (encoder * (plain @ encoder)).sum(0).clamp_min(floor).sqrt()
    spread = spread.clamp_max(MAX_SCALE[root is not None] * h ** 0.5)
    return Transform(basis=rounded, scale=spread.float(), bits=bits, encoder=encoder.float())


COLLINEAR = 1e-3  # a rounded basis's combinations whose metric correlation is below this are not coded apart


def _collinear_pinv(gram: Tensor) -> Tensor:
    """The inverse of a rounded basis's Gram matrix ``D^T M D`` (m, m), except along combinations of directions that
    rounding made (nearly) collinear: on the Gram's correlation matrix (unit diagonal), eigenvalues below
    :data:`COLLINEAR` are dropped (a pseudo-inverse), so such directions are coded by their common part only, not
    by large opposite coefficients whose quantisation errors would not cancel. 4-bit absmax rounding of a column
    dominated by one huge channel can round it to that channel's unit vector, the same as another's."""
    root = gram.diagonal().clamp_min(1e-300).rsqrt()
    corr = gram * root[:, None] * root[None, :]
    lam, vec = torch.linalg.eigh((corr + corr.T) / 2)
    inv = torch.where(lam > COLLINEAR * float(lam.max()), 1.0 / lam.clamp_min(1e-300), torch.zeros_like(lam))
    return (vec * inv) @ vec.T * root[:, None] * root[None, :]


def metric_root(metric: Tensor) -> tuple[Tensor, Tensor]:
    """``(L, L^-1)`` (float64) with ``L = (M H / tr M + METRIC_FLOOR I)^(1/2)`` for a positive semi-definite ``metric``
    M (H, H); ValueError if it is not finite or has no positive trace."""
    m = metric.double()
    h = m.shape[0]
    if m.shape != (h, h) or not bool(torch.isfinite(m).all()):
        raise ValueError(f"metric must be a finite square matrix, got {tuple(m.shape)}")
    tr = float(m.trace())
    if not tr > 0:
        raise ValueError("metric must have a positive trace")
    lam, vec = torch.linalg.eigh((m + m.T) / 2 * (h / tr))
    lam = lam.clamp_min(0) + METRIC_FLOOR
    return (vec * lam.sqrt()) @ vec.T, (vec / lam.sqrt()) @ vec.T


def _bit_layout(bits: Tensor) -> tuple[Tensor, Tensor]:  # which direction and which bit each code bit is
    b = bits.to(torch.int64)
    cols = torch.repeat_interleave(torch.arange(b.shape[0], device=b.device), b)
    starts = torch.cumsum(b, 0) - b
    pos = torch.arange(cols.shape[0], device=b.device) - starts[cols]
    return cols, pos


def tc_encode(x: Tensor, tf: Transform, rms: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Code ``x`` (..., H): returns ``(codes, rms)``: codes (..., ceil(R / 8)) uint8, rms (...) float32. ``rms``
    (...): the token scales to code with (as the receiver will decode them), instead of the exact ones."""
    h = x.shape[-1]
    rows = x.detach().float().reshape(-1, h)
    rms = rows.square().mean(-1).sqrt() if rms is None else rms.detach().float().reshape(-1)
    unit = rows / torch.where(rms > 0, rms, torch.ones_like(rms))[:, None]
    c = unit @ tf.coder.float().to(x.device)  # (N, m)
    b = tf.bits.to(device=x.device, dtype=torch.int64)
    step = torch.tensor(TC_STEP, device=x.device)[b] * tf.scale.to(x.device)
    half = (1 << b)[None, :] // 2
    q = (torch.floor(c / step) + half).clamp(min=torch.zeros_like(half), max=2 * half - 1)  # [0, 2**b)
    cols, pos = _bit_layout(tf.bits.to(x.device))
    stream = (q.to(torch.int64)[:, cols] >> pos) & 1  # (N, R)
    codes = pack_codes(stream.to(torch.uint8), 1)
    return codes.reshape(*x.shape[:-1], -1), rms.reshape(x.shape[:-1])


def tc_decode(codes: Tensor, rms: Tensor, tf: Transform, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of :func:`tc_encode` (up to the quantisation error): (..., H)."""
    dev = codes.device
    r = tf.code_bits
    stream = unpack_codes(codes.reshape(-1, codes.shape[-1]), 1, r).to(torch.int64)  # (N, R)
    cols, pos = _bit_layout(tf.bits.to(dev))
    q = torch.zeros(stream.shape[0], tf.bits.shape[0], dtype=torch.int64, device=dev)
    q.index_add_(1, cols, stream << pos)
    b = tf.bits.to(device=dev, dtype=torch.int64)
    step = torch.tensor(TC_STEP, device=dev)[b] * tf.scale.to(dev)
    c = (q - (1 << b)[None, :] // 2 + 0.5) * step
    out = (c @ tf.basis.float().to(dev).T) * rms.reshape(-1, 1).float()
    return out.reshape(*rms.shape, -1).to(dtype)


def tc_grad(grad: Tensor, tf: Transform) -> Tensor:
    """A gradient with respect to the decoded vector taken back through the code's linear part (quantisation
    straight through): ``grad D E^T`` (..., H), with ``D`` the decode directions (``basis``) and ``E`` the encoder
    (``encoder``, or ``basis``): zero along every direction the code does not send."""
    dev = grad.device
    dec = tf.basis.float().to(dev)
    enc = tf.coder.float().to(dev)
    return (grad.float() @ dec) @ enc.T


def normalised_second_moment(rows: Tensor) -> Tensor:
    """``sum_t e_t e_t^T / rms(e_t)^2`` over the rows (N, H) (float64; rows of zero norm count nothing)."""
    e = rows.double()
    ms = e.square().mean(-1, keepdim=True)
    w = torch.where(ms > 0, 1.0 / ms, torch.zeros_like(ms))
    return (e * w).T @ e


__all__ = ["BASIS_DTYPE", "BASIS_DTYPES", "MAX_CODE_BITS", "TC_MSE", "TC_STEP", "Transform", "allocate_bits",
           "fit_transform", "metric_root", "normalised_second_moment", "tc_decode", "tc_encode",
           "tc_grad"]
