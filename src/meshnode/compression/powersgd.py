"""PowerSGD with error feedback, split into phases so any averager can do the all-reduce.

DP synchronisation averages each stage's pseudo-gradients (start weights minus current weights) over
the stage's replicas (DESIGN.md section 1). PowerSGD (Vogels et al., 2019) replaces a matrix
M (m, n) by a rank-r product P Q^T, so a replica sends r (m + n) numbers instead of m n:

    M   = grad + error                          (error feedback: what earlier rounds failed to send)
    P   = M Q                                   phase_p    -> caller averages P over replicas
    P^  = orthonormalise(P_avg)                 phase_q
    Q   = M^T P^                                phase_q    -> caller averages Q over replicas
    out = P^ Q_avg^T                            finish     (identical on every replica)
    error = M - P^ Q^T                          finish     (local: the part of M this replica failed to send)

Q is warm-started: each tensor keeps the averaged Q of the previous round, so one power iteration
per round tracks the dominant subspace. All replicas must start from the same Q: it is drawn from the
integer PRF (:func:`.prf.uniform`) keyed by ``seed`` and the tensor's name, so peers agree without
talking, on any device. A replica that joins late must load the warm-start state of the others
(:meth:`PowerSGDState.state_dict`) or everyone must :meth:`~PowerSGDState.reset` together.

Tensors that are 1-D, or for which compression would not pay (r (m + n) >= m n, with r capped at
min(m, n)), are sent uncompressed: ``phase_p`` passes them through, the caller averages them with the
P factors, and ``finish`` returns the average. Higher-dimensional tensors are viewed as
(shape[0], rest).

The error is the local residual ``M - P^ Q^T`` with this replica's own Q (as in Vogels et al.), not
``M - P^ Q_avg^T`` (as in torch's DDP hook): the latter re-injects each replica's deviation from the
mean every round, so per-replica errors would grow like a random walk even though their mean is the
same.

With ``quantize=True``, P and Q are rounded to int8 with one absmax scale per column (of the (m, r)
and (n, r) factors) before averaging; error feedback sees the rounded Q, so it compensates.

Byte counts: :attr:`PowerSGDState.last_bytes` is what this replica handed to the averager in its last
round (P factors + uncompressed tensors + Q factors, in wire form); the all-reduce's own transport
multiplier (about 2 (n-1)/n for hivemind's butterfly all-reduce) is the averager's business.

Orthonormalisation is classical Gram-Schmidt applied twice (CGS2), column by column: unlike
Householder QR it has no sign ambiguity that could differ between LAPACK and cuSOLVER. A column that
is (numerically) dependent on the earlier ones is set to zero, and the matching warm-start column is
redrawn from the PRF so the rank is not lost for good.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from .accounting import ByteCounter, tensor_bytes
from .prf import fold_seed, uniform
from .quant import fake_quantize, quantized_nbytes

logger = logging.getLogger(__name__)

_Q_DOMAIN = 0x50534744  # "PSGD"
_EPS = 1e-7


def orthonormalize(p: Tensor, eps: float = _EPS) -> Tensor:  # (..., m, r) -> (..., m, r)
    """Orthonormal columns spanning ``p``'s columns, by CGS2; dependent columns become zero. Leading dimensions
    are a batch of independent matrices."""
    p = p.to(torch.float32).clone()
    r = p.shape[-1]
    # no host sync (no float() of a device tensor): on a GPU shared by several processes each sync waited for the
    # others' time slices, and a DP round made r + 1 of them per tensor (docs/quality.md, GPU sweep)
    scale = torch.linalg.matrix_norm(p)[..., None, None]
    floor = eps * torch.where(scale > 0, scale, torch.ones_like(scale))
    for i in range(r):
        col = p[..., i : i + 1]  # (..., m, 1)
        if i:
            prev = p[..., :i]
            for _ in range(2):
                col = col - prev @ (prev.mT @ col)
        norm = torch.linalg.vector_norm(col, dim=-2, keepdim=True)
        p[..., i : i + 1] = torch.where(norm > floor, col / norm.clamp_min(floor), torch.zeros_like(col))
    return p


def orthonormalize_all(factors: Mapping[str, Tensor], eps: float = _EPS) -> dict[str, Tensor]:
    """:func:`orthonormalize` of every ``(m, r)`` factor, those of one shape and device as one batch (sorted by
    name, so every peer batches alike): a stage's ~70 matrices come in 3-4 shapes, so a round launches ~20x fewer
    small kernels. Every user of a round's P^ (the replicas and the DP log the anchor decodes) calls this."""
    groups: dict[tuple, list[str]] = {}
    for name in sorted(factors):
        t = factors[name]
        groups.setdefault((tuple(t.shape), str(t.device)), []).append(name)
    out: dict[str, Tensor] = {}
    for names in groups.values():
        out.update(zip(names, orthonormalize(torch.stack([factors[n] for n in names]), eps).unbind(0)))
    return {name: out[name] for name in factors}


def compressed_rank(shape: tuple[int, ...] | torch.Size, rank: int) -> int:
    """The rank a tensor of ``shape`` is compressed with, or 0 if it is sent uncompressed."""
    if len(shape) < 2:
        return 0
    m = int(shape[0])
    n = 1
    for d in shape[1:]:
        n *= int(d)
    r = min(rank, m, n)
    return r if r > 0 and r * (m + n) < m * n else 0


class PowerSGDState:
    """One replica's PowerSGD state: warm-start Q and error-feedback buffers, per tensor name.

    A round is ``phase_p`` -> (caller averages) -> ``phase_q`` -> (caller averages) -> ``finish``.
    """

    def __init__(self, rank: int, quantize: bool = False, *, seed: int = 0) -> None:
        if rank <= 0:
            raise ValueError(f"PowerSGD rank must be > 0, got {rank}")
        self.rank = rank
        self.quantize = quantize
        self.seed = seed
        self.errors: dict[str, Tensor] = {}  # name -> (m, n) float32
        self.warm_q: dict[str, Tensor] = {}  # name -> (n, r) float32, identical on all replicas
        self.last_bytes = 0
        self.rounds = 0
        self._reset_round()

    def _reset_round(self) -> None:
        self._phase = "idle"
        self._shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._m: dict[str, Tensor] = {}
        self._p_hat: dict[str, Tensor] = {}
        self._q_local: dict[str, Tensor] = {}
        self._dense: list[str] = []
        self._dense_avg: dict[str, Tensor] = {}
        self._bytes = 0

    def reset(self) -> None:
        """Drop error feedback and warm starts (all replicas of a group must do it together)."""
        self.errors.clear()
        self.warm_q.clear()
        self._reset_round()

    def abandon(self) -> None:
        """Drop the round in progress: error feedback and warm starts stay as they were before it (only a
        tensor's first warm start, drawn from the seed, is kept)."""
        self._reset_round()

    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        return {"errors": dict(self.errors), "warm_q": dict(self.warm_q)}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Tensor]]) -> None:
        self.errors = {k: v.to(torch.float32).clone() for k, v in state.get("errors", {}).items()}
        self.warm_q = {k: v.to(torch.float32).clone() for k, v in state.get("warm_q", {}).items()}
        self._reset_round()

    # -- helpers

    def _initial_q(self, name: str, n: int, r: int, device: torch.device) -> Tensor:  # (n, r)
        seed = fold_seed(self.seed, zlib.crc32(name.encode()), n, r, domain=_Q_DOMAIN)
        return uniform(seed, (n, r), device)

    def _factor_bytes(self, rows: int, r: int) -> int:
        return quantized_nbytes(r, rows, 8) if self.quantize else rows * r * 4

    def _wire(self, factor: Tensor) -> Tensor:  # (rows, r): per-column int8 rounding if quantising
        return fake_quantize(factor, 8, dim=0) if self.quantize else factor

    # -- phases

    def phase_p(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Start a round: returns P (m, r) per compressed tensor and a float32 copy of each other tensor.

        The caller averages every returned entry over the replicas and passes the result to
        :meth:`phase_q`.
        """
        if self._phase != "idle":
            logger.warning("PowerSGD round restarted before finish (phase %s); dropping it", self._phase)
        self._reset_round()
        out: dict[str, Tensor] = {}
        for name, t in tensors.items():
            self._shapes[name] = (t.shape, t.dtype)
            r = compressed_rank(t.shape, self.rank)
            if r == 0:
                self._dense.append(name)
                dense = t.detach().to(torch.float32).clone()
                out[name] = dense
                self._bytes += tensor_bytes(dense)
                continue
            mat = t.detach().to(torch.float32).reshape(t.shape[0], -1)
            m, n = mat.shape
            err = self.errors.get(name)
            if err is not None and err.shape == mat.shape:
                mat = mat + err.to(mat.device)
            q = self.warm_q.get(name)
            if q is None or q.shape != (n, r):
                q = self._initial_q(name, n, r, mat.device)
                self.warm_q[name] = q
            self._m[name] = mat
            out[name] = self._wire(mat @ q.to(mat.device))
            self._bytes += self._factor_bytes(m, r)
        self._phase = "p"
        return out

    def phase_q(self, p_avg: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Given the averaged :meth:`phase_p` output, return Q = M^T P^ (n, r) per compressed tensor."""
        if self._phase != "p":
            raise RuntimeError(f"phase_q called in phase {self._phase!r}; call phase_p first")
        missing = set(self._shapes) - set(p_avg)
        if missing:
            raise KeyError(f"averaged P is missing tensors: {sorted(missing)}")
        out: dict[str, Tensor] = {}
        for name in self._dense:
            self._dense_avg[name] = p_avg[name]
        p_hats = orthonormalize_all({name: p_avg[name].to(device=mat.device, dtype=torch.float32)
                                     for name, mat in self._m.items()})
        for name, mat in self._m.items():
            p_hat = p_hats[name]
            self._p_hat[name] = p_hat
            q = self._wire(mat.T @ p_hat)
            self._q_local[name] = q
            out[name] = q
            self._bytes += self._factor_bytes(mat.shape[1], p_hat.shape[1])
        self._phase = "q"
        return out

    def finish(self, q_avg: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Given the averaged :meth:`phase_q` output, return every tensor's averaged approximation.

        Shapes and dtypes are those given to :meth:`phase_p`. Updates error feedback and warm starts.
        """
        if self._phase != "q":
            raise RuntimeError(f"finish called in phase {self._phase!r}; call phase_q first")
        missing = set(self._m) - set(q_avg)
        if missing:
            raise KeyError(f"averaged Q is missing tensors: {sorted(missing)}")
        out: dict[str, Tensor] = {}
        for name, (shape, dtype) in self._shapes.items():
            if name in self._dense_avg:
                out[name] = self._dense_avg[name].to(dtype).reshape(shape).clone()
                continue
            mat, p_hat = self._m[name], self._p_hat[name]
            q = q_avg[name].to(device=mat.device, dtype=torch.float32)
            out[name] = (p_hat @ q.T).reshape(shape).to(dtype)
            self.errors[name] = mat - p_hat @ self._q_local[name].T
            warm = q.clone()
            dead = p_hat.norm(dim=0) == 0  # dependent columns: redraw, so the rank is not lost
            if bool(dead.any()):
                fresh = self._initial_q(f"{name}#{self.rounds}", warm.shape[0], warm.shape[1], warm.device)
                warm[:, dead] = fresh[:, dead]
            self.warm_q[name] = warm
        self.last_bytes = self._bytes
        self.rounds += 1
        self._reset_round()
        return out

    @torch.no_grad()
    def keep_residual(self, params: Mapping[str, Tensor], names: Iterable[str]) -> None:
        """Move each named tensor's residual out of error feedback and into ``params`` (``params -= error``).

        Call after the outer step has set ``params`` to the new start weights: the replica then stands at
        ``start - error``, with the progress its round did not send applied locally instead of held back until a
        later round sends it. Its next pseudo-gradient (``start - params``) holds the residual, so the error is
        zeroed: what travels later is the same, and the replicas' mean is the exact average of their weights
        before the round (with plain averaging), while each replica differs from it by its own residual."""
        for name in names:
            err = self.errors.get(name)
            if err is None:
                continue
            p = params[name]
            p.sub_(err.reshape(p.shape).to(device=p.device, dtype=p.dtype))
            err.zero_()

    def round_bytes(self, tensors: Mapping[str, Tensor]) -> int:
        """Bytes a round over ``tensors`` hands to the averager (without running it)."""
        total = 0
        for t in tensors.values():
            r = compressed_rank(t.shape, self.rank)
            if r == 0:
                total += t.numel() * 4
            else:
                m = int(t.shape[0])
                total += self._factor_bytes(m, r) + self._factor_bytes(t.numel() // m, r)
        return total


def powersgd_decode(
    p_hat: Mapping[str, Tensor], q_avg: Mapping[str, Tensor], shapes: Mapping[str, torch.Size | tuple[int, ...]],
    rank: int,
) -> dict[str, Tensor]:
    """The averaged approximation of a round from what its two averages left behind (float32).

    ``p_hat``: per compressed tensor the orthonormalised averaged P (what :meth:`PowerSGDState.phase_q`
    computes, ``orthonormalize_all(P_avg)``), per uncompressed tensor its average; ``q_avg``: the averaged Q of the
    compressed tensors. Returns what :meth:`PowerSGDState.finish` returns, ``P^ Q_avg^T`` or the average,
    computed by someone who holds no state of the round: a peer that follows the DP rounds without taking
    part (the anchor with ``anchor.snapshot = "dp"``). Every factor must have the shape the round gives it
    (``(m, r)`` and ``(n, r)`` with ``r = compressed_rank(shape, rank)``), else ValueError.
    """
    out: dict[str, Tensor] = {}
    extra = set(p_hat) - set(shapes) or set(q_avg) - set(shapes)
    if extra:
        raise ValueError(f"factors of unknown tensors: {sorted(extra)[:3]}")
    for name, shape in shapes.items():
        if name not in p_hat:
            raise ValueError(f"no factor for {name!r}")
        p = p_hat[name]
        numel = math.prod(shape)
        r = compressed_rank(shape, rank)
        if r == 0:
            if name in q_avg or p.numel() != numel:
                raise ValueError(f"{name!r}: expected the whole tensor ({numel} values), got {tuple(p.shape)}")
            out[name] = p.to(torch.float32).reshape(shape).clone()
            continue
        m = int(shape[0])
        q = q_avg.get(name)
        if q is None or tuple(p.shape) != (m, r) or tuple(q.shape) != (numel // m, r):
            raise ValueError(f"{name!r}: factors must be ({m}, {r}) and ({numel // m}, {r}), got "
                             f"{tuple(p.shape)} and {None if q is None else tuple(q.shape)}")
        out[name] = (p.to(torch.float32) @ q.to(torch.float32).T).reshape(shape)
    return out


def _mean(dicts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {k: torch.stack([d[k] for d in dicts]).mean(0) for k in dicts[0]}


def powersgd_allreduce(
    states: list[PowerSGDState],
    tensors_per_replica: list[Mapping[str, Tensor]],
    counters: list[ByteCounter] | None = None,
) -> tuple[list[dict[str, Tensor]], list[int]]:
    """Run one PowerSGD round for several replicas in one process, the mean as the all-reduce.

    Returns ``(outputs, bytes_sent)``: each replica's result (identical across replicas) and the bytes
    each replica handed to the averager (also in each state's ``last_bytes``). With ``counters`` (one
    per replica) those bytes are also added on the ``dp`` axis.
    """
    if len(states) != len(tensors_per_replica) or not states:
        raise ValueError("need one state per replica, and at least one replica")
    ps = [s.phase_p(t) for s, t in zip(states, tensors_per_replica, strict=True)]
    p_avg = _mean(ps)
    qs = [s.phase_q(p_avg) for s in states]
    q_avg = _mean(qs)
    outs = [s.finish(q_avg) for s in states]
    sent = [s.last_bytes for s in states]
    if counters is not None:
        for n, c in zip(sent, counters, strict=True):
            c.add("dp", n)
    return outs, sent


__all__ = [
    "PowerSGDState", "compressed_rank", "orthonormalize", "orthonormalize_all", "powersgd_allreduce",
    "powersgd_decode",
]
