"""Reference coding of stage boundaries (``mask.reference``): code what fine-tuning changed, not the whole tensor.

Every peer starts from the same pretrained weights, which it loads from disk; the microbatch's token ids travel
with it to every stage. So both ends of a boundary can compute, for the same tokens, what the *pretrained*
model would send across it, and the sender codes only the difference:

- forward (``reference = "forward"`` or ``"both"``): the sender of boundary b encodes ``h - h_ref``, where
  ``h_ref`` is the output of the frozen pretrained stages 0..b on the ids; the receiver decodes and adds its
  own ``h_ref``. A channel the mask drops, or a coordinate the quantiser rounds, then costs its *change* from
  the pretrained value, not its value: zero-filling 95 % of the channels puts the pretrained value there.
- backward (``"both"``): the gradient's sender (stage b + 1) encodes ``g - g_ref``, where ``g_ref`` is the
  gradient of the frozen stages b + 1..end's loss at the decoded boundary input ``x_hat`` (the one both ends
  know: the receiver of the gradient decodes its own payload to get it); the receiver adds its own ``g_ref``.

``scripts/probe_reference_coding.py`` measured the residuals on SmolLM2-135M (``docs/quality.md``): after 10 to
150 dense steps they are a small fraction of the tensors, so a codec spends its bits on far less.

The price is compute and memory, not bytes: a peer holds the whole pretrained model frozen, and per microbatch
runs the frozen stages before its boundaries forward (no graph) and, for the gradient, the frozen stages after
its boundaries forward and backward (input gradient only). :class:`ReferenceModel` counts the frozen stage passes
it ran (``stage_forwards``, ``stage_backwards``). In one process (the mesh) a result is computed once and shared
by both ends (they would compute the same numbers); the counters say what was computed, and
:func:`peer_passes` what each peer of a swarm computes.

Both ends must compute the same reference to float rounding: same weights (the pretrained ones, never trained),
same autocast. In the swarm :attr:`ReferenceModel.digest` names both, and the next stage refuses a caller whose
digest is not its own. A numeric difference of the same computation (another device's kernels) is what the
reference check measures (``mask.reference_check``): every coded activation carries a few entries of its sender's
reference (:func:`with_check`; with ``both`` of its reference gradient too), and the receiver refuses it when they
differ from its own by more than ``mask.reference_tolerance`` (``StageWorker._compare_reference``).

**The residual map** (``mask.reference_map_rank`` k > 0, forward only). Part of what fine-tuning changes at a
boundary is a function of the pretrained value itself: ``scripts/probe_residual_predictor.py`` found a linear map
``r ~ centre(h_ref) A`` that, fitted on the training microbatches a sender has just seen, halves what the 1-bit
residual code costs the held-out loss (``docs/quality.md``). :class:`ResidualMap` is the sender's side: it
accumulates the statistics of (h_ref, r) over its microbatches, refits a rank-k ``A = U V^T`` (ridge regression,
then reduced rank) every ``mask.reference_map_period`` steps (the first after ``mask.reference_map_first``, see
:func:`fits_after`), and sends ``U`` and ``V`` (2 k H values in bfloat16) once with the next payload; from then
on it codes ``r - centre(h_ref) U V^T``. :class:`MapStore` is the
receiver's: it keeps the maps it was sent, by sender and version, and adds the same prediction back. Every payload
coded against a map names it (``meta["ref_map"] = [sender, version]``); a receiver that lacks it refuses the
microbatch. In the mesh a map goes out once, with the next payload; in the swarm the sending host attaches it
to the first payload for each peer it calls (``meshnode.node.host``), again after a refusal.

**The transform codes** (``mask.reference_code_bits`` R, ``mask.reference_grad_code_bits`` G). What the map leaves of
the residual is not isotropic either: ``scripts/probe_transform_coding.py`` found half its (per-token normalised)
energy in 64 of 576 directions. With R > 0 each fit of the map also fits a transform code of R bits per token for
it (:mod:`meshnode.compression.transform`: the eigenvectors of its second moment, bits by variance), which travels
with the map and replaces the rotated code of the activation (R = 288 is half a bit per coordinate). With G > 0 the
gradient's sender (the later stage) keeps a :class:`ResidualMap` of rank 0 for ``g - g_ref`` (uncentred) and ships
its code with its gradients: in the mesh once per fit, in the swarm with the reply to a caller whose request does
not list it among the codes it holds (``held_codes``), so a caller that restarted gets it again.

``mask.reference_fit_bits = 8`` sends a fit's (H, k) matrices as int8 with a float32 step per column (about half
its bytes; both ends use the decoded values), ``4`` as 4-bit codes two to a byte (about a quarter);
``mask.reference_basis_bits`` sets the codes' bases apart from the map (0: as the map). The sender fits its code's
encoder to the basis as rounded (:func:`meshnode.compression.fit_transform`'s ``round_basis``).
``mask.reference_code_metric = "fisher"`` weights the activation's code by the empirical Fisher of the boundary,
from the gradients its sender receives (``observe_grad``); nothing changes on the wire. ``mask.reference_code_grad =
"project"`` has the sender apply the gradient it receives through its code's linear part
(:func:`meshnode.compression.tc_grad`, in ``StageWorker.backward``): its weights are not pushed along the directions
the code did not send, which the next stage never saw.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import secrets
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

from ..compression import (
    REF_CHECK_TENSOR,
    REF_CODE_TENSORS,
    REF_FIT_STEP_TENSORS,
    REF_MAP_META,
    REF_MAP_TENSORS,
    EncodedPayload,
    PayloadError,
    Transform,
)
from ..compression.quant import dequantize_absmax, quantize_absmax, unpack_int4
from ..compression.transform import MAX_CODE_BITS, fit_transform
from .moves import Move, apply_move

REFERENCE_MODES = ("none", "forward", "both")


class ReferenceModel:
    """The frozen pretrained stages, and the boundary tensors they give for a microbatch's token ids.

    ``stages``: every stage's module as loaded (copied here, frozen). ``autocast``: a context factory, the one
    the training workers use (the reference is computed the same way on both ends). Results are kept per key
    (a microbatch of a replica chain) for the last ``max_keys`` keys, checked against the ids they were made
    from, so the two ends of a boundary in one process share one computation.
    """

    def __init__(self, stages: Sequence[torch.nn.Module], *, autocast: Callable[[], contextlib.AbstractContextManager]
                 | None = None, max_keys: int = 32, copy_modules: bool = True):
        self.stages = [copy.deepcopy(m) if copy_modules else m for m in stages]
        for m in self.stages:
            m.eval()
            for p in m.parameters():
                p.requires_grad_(False)
        self.autocast = autocast or contextlib.nullcontext
        self.max_keys = max_keys
        self._acts: OrderedDict[Hashable, tuple[Tensor, list[Tensor]]] = OrderedDict()
        self._grads: OrderedDict[tuple[Hashable, int], tuple[Tensor, Tensor, Tensor]] = OrderedDict()
        self.stage_forwards = 0  # frozen stage passes computed (not served from the cache)
        self.stage_backwards = 0
        self._weights_hash: str | None = None
        self._digests: dict[str, str] = {}  # precision -> digest (every forward request carries one)
        # reference moves (mask.reference_refresh_rank): how many each stage took, and per stage a hash chaining the
        # moves applied since the weights were hashed last (the digest names them instead of hashing every weight)
        self.versions = [0] * len(self.stages)
        self._moves_hash = [""] * len(self.stages)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @torch.no_grad()
    def load_weights(self, weights: Sequence[dict[str, Tensor]]) -> None:
        """Take new frozen weights, every stage's ``name -> tensor`` (``mask.reference_refresh``: the reference follows
        training). Every name of every stage must be given with its shape; a ValueError leaves the weights as they
        were. The held results and the digest are dropped (they were computed from the old weights)."""
        if len(weights) != self.num_stages:
            raise ValueError(f"reference weights for {len(weights)} stages, the reference has {self.num_stages}")
        for s, (m, given) in enumerate(zip(self.stages, weights)):
            own = dict(m.named_parameters())
            if set(given) != set(own) or any(tuple(given[n].shape) != tuple(p.shape) for n, p in own.items()):
                raise ValueError(f"reference weights of stage {s} do not match its parameters (names or shapes)")
            if not all(bool(torch.isfinite(t).all()) for t in given.values()):
                raise ValueError(f"reference weights of stage {s} are not finite")
        for m, given in zip(self.stages, weights):
            for n, p in m.named_parameters():
                p.copy_(given[n])
        self._acts.clear()
        self._grads.clear()
        self._weights_hash = None
        self._moves_hash = [""] * self.num_stages
        self._digests.clear()

    @torch.no_grad()
    def apply_move(self, stage: int, move: Move) -> None:
        """Move ``stage``'s weights by a reference move (:mod:`.moves`, checked by its receiver) and count it in
        :attr:`versions`. The digest then names the weights before the first move and, per stage, every move since
        in order, by their bytes: two holders agree on it when they started from the same weights and applied the
        same moves of each stage, in whatever order across stages (what makes their weights the same is that they
        run the same kernels; ``mask.reference_check`` measures it). A move of names or shapes that do not fit, or
        that would give non-finite weights, is a ValueError, and nothing changes."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is not one of the reference's {self.num_stages}")
        held = dict(self.stages[stage].named_parameters())
        if set(move) != set(held):
            raise ValueError(f"a reference move of stage {stage} does not name its parameters")
        moved = apply_move(held, move)
        if not all(bool(torch.isfinite(t).all()) for t in moved.values()):
            raise ValueError(f"reference move of stage {stage} gives non-finite weights; not applied")
        if self._weights_hash is None:
            self._weights_hash = self._hash_weights()  # the weights the moves start from
        h = hashlib.sha256(f"{self._moves_hash[stage]}/{stage}/{self.versions[stage] + 1};".encode())
        for n in sorted(move):
            for part in sorted(move[n]):
                t = move[n][part].detach().cpu().contiguous()
                h.update(f"{n}/{part}/{t.dtype}/{tuple(t.shape)};".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy())
        for n, p in held.items():
            p.copy_(moved[n])
        self.versions[stage] += 1
        self._moves_hash[stage] = h.hexdigest()
        self._acts.clear()
        self._grads.clear()
        self._digests.clear()

    def digest_for(self, stages: Sequence[int]) -> str:
        """The digest of the weights before any move and of ``stages``' moves only: what the two ends of a boundary
        compare when their peers follow different sets of stages (``mask.reference = forward``)."""
        if self._weights_hash is None:
            self._weights_hash = self._hash_weights()
        chains = "/".join(f"{s}:{self._moves_hash[s]}" for s in sorted(stages))
        return hashlib.sha256(f"{self._weights_hash}/{chains}/{self.precision}".encode()).hexdigest()[:16]

    def _hash_weights(self) -> str:
        h = hashlib.sha256()
        for s, m in enumerate(self.stages):
            for name, t in sorted(m.state_dict().items()):
                t = t.detach().cpu()
                h.update(f"{s}/{name}/{t.dtype}/{tuple(t.shape)};".encode())
                h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
        return h.hexdigest()

    @property
    def digest(self) -> str:
        """A short hash of every stage's frozen weights (names, dtypes, shapes, bytes; hashed once) and of the
        autocast it computes under: two peers whose boundaries are coded against the reference must have the
        same (a sender's residual decodes to the right activation only against the sender's own reference),
        and the swarm compares these."""
        precision = self.precision  # a peer under bf16 autocast and one in float32 differ by bf16's rounding
        if precision not in self._digests:
            if self._weights_hash is None:
                self._weights_hash = self._hash_weights()
            moves = "".join(f"/{s}:{h}" for s, h in enumerate(self._moves_hash) if h)
            self._digests[precision] = hashlib.sha256(
                f"{self._weights_hash}{moves}/{precision}".encode()).hexdigest()[:16]
        return self._digests[precision]

    @property
    def origin_digest(self) -> str:
        """:attr:`digest` of the weights before the first reference move (the same as :attr:`digest` until then):
        what a peer's record names, which stays put while the moves come in (``meshnode status`` compares it)."""
        if self._weights_hash is None:
            self._weights_hash = self._hash_weights()
        return hashlib.sha256(f"{self._weights_hash}/{self.precision}".encode()).hexdigest()[:16]

    @property
    def precision(self) -> str:
        """The autocast this reference computes under (``"float32"`` without one), from :attr:`autocast`."""
        with self.autocast():
            for device in ("cpu", "cuda"):
                if torch.is_autocast_enabled(device):
                    return f"autocast {device} {torch.get_autocast_dtype(device)}"
        return "float32"

    def _dtype(self, s: int) -> torch.dtype:
        return next(self.stages[s].parameters()).dtype

    @staticmethod
    def _touch(cache: OrderedDict, key, value, limit: int) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > limit:
            cache.popitem(last=False)

    @torch.no_grad()
    def activation(self, key: Hashable, ids: Tensor, boundary: int) -> Tensor:
        """The pretrained model's output of stage ``boundary`` for ``ids`` ``(B, T)``: float32 ``(B, T, H)``."""
        if not 0 <= boundary < self.num_stages - 1:
            raise ValueError(f"boundary {boundary} is not between two of {self.num_stages} stages")
        held = self._acts.get(key)
        acts = held[1] if held is not None and torch.equal(held[0], ids) else []
        with self.autocast():
            while len(acts) <= boundary:
                s = len(acts)
                x = ids if s == 0 else acts[-1].to(self._dtype(s))
                acts.append(self.stages[s](x).float())
                self.stage_forwards += 1
        self._touch(self._acts, key, (ids, acts), self.max_keys)
        return acts[boundary]

    def input_grad(self, key: Hashable, ids: Tensor, boundary: int, x: Tensor, scale: float = 1.0) -> Tensor:
        """The gradient of ``scale`` x the frozen stages ``boundary + 1 ..``'s mean next-token loss on ``ids``
        with respect to their input ``x`` (the decoded boundary ``boundary``): float32, ``x``'s shape."""
        if not 0 <= boundary < self.num_stages - 1:
            raise ValueError(f"boundary {boundary} is not between two of {self.num_stages} stages")
        from .worker import causal_lm_loss

        held = self._grads.get((key, boundary))
        if held is not None and torch.equal(held[0], ids) and torch.equal(held[1], x):
            return held[2]
        leaf = x.detach().to(self._dtype(boundary + 1)).requires_grad_(True)
        with torch.enable_grad(), self.autocast():
            y = leaf
            for s in range(boundary + 1, self.num_stages):
                y = self.stages[s](y)
                self.stage_forwards += 1
            loss = causal_lm_loss(y, ids) * scale
        (g,) = torch.autograd.grad(loss, leaf)
        self.stage_backwards += self.num_stages - boundary - 1
        g = g.float()
        self._touch(self._grads, (key, boundary), (ids, x.detach().clone(), g), self.max_keys)
        return g


def fits_after(step: int, mask) -> bool:
    """Whether a sender refits its residual map and transform codes after the (0-based) ``step``: first after step
    ``mask.reference_map_first`` (1-based; 0 = the period), then every ``mask.reference_map_period`` steps."""
    period = mask.reference_map_period
    done = step + 1 - (mask.reference_map_first or period)
    return done >= 0 and done % period == 0


def peer_plan(stage: int, num_stages: int, mode: str) -> tuple[list[int], list[int]]:
    """The frozen stages a swarm peer of ``stage`` runs per microbatch for ``mode``: (forward only, forward and
    input backward).

    Forward only: the prefix 0..b of each boundary b it receives (b = stage - 1) or sends (b = stage), computed
    once (0..stage, or 0..stage - 1 on the last stage). With ``"both"``, for each boundary it receives a gradient
    on (b = stage) or sends one on (b = stage - 1), the frozen stages after it, forward and backward.
    """
    if mode not in REFERENCE_MODES:
        raise ValueError(f"reference mode must be one of {', '.join(REFERENCE_MODES)}, got {mode!r}")
    if mode == "none" or num_stages < 2:
        return [], []
    last = stage == num_stages - 1
    prefix = list(range(stage if last else stage + 1))
    suffixes: list[int] = []
    if mode == "both":
        for b in ([stage] if not last else []) + ([stage - 1] if stage > 0 else []):
            suffixes += list(range(b + 1, num_stages))
    return prefix, suffixes


def follower_stages(stage: int, num_stages: int, mode: str) -> list[int]:
    """The stages other than ``stage`` whose peers compute ``stage``'s frozen weights for ``mode``
    (:func:`peer_plan`): where the weights of a reference that moves must reach (``mask.reference_refresh``)."""
    out = []
    for s in range(num_stages):
        prefix, suffixes = peer_plan(s, num_stages, mode)
        if s != stage and (stage in prefix or stage in suffixes):
            out.append(s)
    return out


def peer_passes(stage: int, num_stages: int, mode: str) -> tuple[int, int]:
    """How many frozen stage passes :func:`peer_plan` makes: (forwards, backwards)."""
    prefix, suffixes = peer_plan(stage, num_stages, mode)
    return len(prefix) + len(suffixes), len(suffixes)


MAP_META = REF_MAP_META  # payload meta: [sender, version] of the map the residual was coded against
MAP_TENSORS = REF_MAP_TENSORS  # payload tensors: the map itself, (H, k) each, once per version and receiver
CODE_TENSORS = REF_CODE_TENSORS  # payload tensors: the transform code fitted with it (mask.reference_code_bits)
# mask.reference_fit_bits = 8 or 4: the (H, k) matrices of a fit (U, V, the basis) as int8 (or 4-bit codes packed two
# rows to a byte), and these: a float32 step per column
STEP_TENSORS = REF_FIT_STEP_TENSORS
MATRIX_TENSORS = (*MAP_TENSORS, CODE_TENSORS[0])  # the fit's (H, k) matrices, in STEP_TENSORS' order
MAP_DTYPE = torch.bfloat16
FIT_BITS = (16, 8, 4)  # mask.reference_fit_bits: the fit's matrices in bfloat16, or 8 or 4 bits per value
MAX_MAP_SENDERS = 16  # senders whose maps a receiver keeps (the least recently used go first)


@dataclasses.dataclass(frozen=True)
class MapFit:
    """One version of a boundary's residual model: the map ``U V^T`` (None at rank 0) and the transform code of
    what it leaves (None without ``mask.reference_code_bits``)."""

    u: Tensor | None
    v: Tensor | None
    transform: Transform | None = None
    # what travels when it is not the tensors above (8- or 4-bit matrices: their codes and steps; u, v and the basis
    # are then the float32 values both ends decode from them)
    wire: dict[str, Tensor] | None = dataclasses.field(default=None, compare=False)

    def tensors(self) -> dict[str, Tensor]:
        """What travels: the map's and the transform's tensors, by payload name."""
        if self.wire is not None:
            return dict(self.wire)
        out = {} if self.u is None else {MAP_TENSORS[0]: self.u, MAP_TENSORS[1]: self.v}
        if self.transform is not None:
            tf = self.transform
            out.update(zip(CODE_TENSORS, (tf.basis, tf.scale, tf.bits)))
        return out

    def nbytes(self) -> int:
        """Wire bytes of this fit when it travels."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def predict(self, h_ref: Tensor) -> Tensor:
        """The predicted residual for ``h_ref`` (zero without a map): float32, ``h_ref``'s shape."""
        if self.u is None:
            return torch.zeros_like(h_ref, dtype=torch.float32)
        return apply_map(h_ref, self.u.to(h_ref.device), self.v.to(h_ref.device))


def _fit_state(fit: MapFit) -> dict:
    """A :class:`MapFit` as plain containers of tensors (what ``torch.load(weights_only=True)`` reads back)."""
    tf = fit.transform
    return {"u": fit.u, "v": fit.v, "wire": fit.wire,
            "transform": None if tf is None else {"basis": tf.basis, "scale": tf.scale, "bits": tf.bits,
                                                  "encoder": tf.encoder}}


def _fit_from_state(state: dict) -> MapFit:
    tf = state["transform"]
    transform = None if tf is None else Transform(tf["basis"], tf["scale"], tf["bits"], encoder=tf["encoder"])
    return MapFit(state["u"], state["v"], transform, state["wire"])


def _quantized_columns(name: str, x: Tensor, wire: dict[str, Tensor], bits: int, unit: bool = False) -> Tensor:
    """Put the (H, k) matrix ``x`` in ``wire`` as payload tensor ``name`` in ``bits`` (8 or 4) bits per value with a
    float32 step per column (``mask.reference_fit_bits``): int8 (H, k), or 4-bit codes packed two rows to a byte,
    uint8 (ceil(H / 2), k). Returns the values both ends decode from it (float32). ``unit`` (a code's basis, whose
    columns are unit vectors) with 4 bits: each column's step is 1 / the norm of its codes, so the column decodes to
    unit length (4-bit rounding alone moves the norm by a few per cent); 8-bit steps stay absmax / 127."""
    q, step = quantize_absmax(x.T, bits)  # a row of x.T is a column of x
    if unit and bits == 4:
        norm = unpack_int4(q, x.shape[0]).float().norm(dim=-1)
        step = torch.where(norm > 0, 1.0 / norm.clamp_min(1e-30), step)
    wire[name], wire[STEP_TENSORS[MATRIX_TENSORS.index(name)]] = q.T.contiguous(), step
    return _decode_columns(wire[name], step, bits, x.shape[0])


def _rounded(name: str, x: Tensor, wire: dict[str, Tensor] | None, bits: int, unit: bool = False) -> Tensor:
    """The (H, k) fit matrix ``x`` as both ends will use it: bfloat16 (``bits`` 16), or decoded from 8 or 4 bits per
    value (:func:`_quantized_columns`); put in ``wire`` as payload tensor ``name`` when there is one."""
    if bits == 16:
        t = x.to(MAP_DTYPE)
        if wire is not None:
            wire[name] = t
        return t
    return _quantized_columns(name, x, wire, bits, unit)


def _check_fit_bits(fit_bits: int, basis_bits: int | None) -> tuple[int, int]:
    """(bits of the map's matrices, bits of a code's basis); ``basis_bits`` None or 0: the map's."""
    basis_bits = basis_bits or fit_bits
    for key, b in (("reference_fit_bits", fit_bits), ("reference_basis_bits", basis_bits)):
        if b not in FIT_BITS:
            raise ValueError(f"mask.{key} must be one of {FIT_BITS}, got {b}")
    return int(fit_bits), int(basis_bits)


def _decode_columns(q: Tensor, step: Tensor, bits: int, rows: int) -> Tensor:
    """float32 (rows, k) from the codes of :func:`_quantized_columns` and a step per column (k,)."""
    return dequantize_absmax(q.T, step, bits, rows).T.contiguous()


def _wire_rows(hidden: int, bits: int) -> int:
    """Rows of an (H, k) fit matrix on the wire: H, or ceil(H / 2) with two 4-bit codes a byte."""
    return (hidden + 1) // 2 if bits == 4 else hidden


def _centred_rows(x: Tensor) -> Tensor:
    """``x`` (B, T, H) as (B T, H) float32 rows minus their mean (the microbatch's channel means)."""
    rows = x.detach().float().reshape(-1, x.shape[-1])
    return rows - rows.mean(dim=0, keepdim=True)


def apply_map(h_ref: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """The predicted residual ``centre(h_ref) U V^T``: float32, ``h_ref``'s shape."""
    rows = _centred_rows(h_ref)
    return ((rows @ u.float()) @ v.float().T).reshape(h_ref.shape)


class ResidualMap:
    """The sender's side of the residual map of one boundary (see the module docstring).

    ``observe`` adds a microbatch's (h_ref, exact residual) to the statistics; ``refit`` solves for a new map
    from the statistics gathered since the last fit (ridge ``ridge`` x tokens on channel-standardised inputs, so
    the residual stream's few huge channels do not set the penalty for all; then the k directions that carry
    most of the fitted values) and starts a new version; ``predict`` gives the current map's prediction (zero
    before the first fit); ``attach`` names the version in a payload and, the first time, carries the map.

    With ``code_bits`` > 0 each version also carries a transform code of ``code_bits`` bits per token
    (:mod:`meshnode.compression.transform`) for what the new map leaves of the residual, fitted from the
    per-token normalised second moment of ``r - centre(h_ref) U V^T`` over the same microbatches (computed
    exactly for the new map from weighted statistics: each token weighted by 1 / its residual's mean square).
    ``rank`` may then be 0 (no map, only the code). ``fit_bits`` 8 (4) sends the (H, k) matrices of a fit in 8 (4)
    bits per value (a float32 step per column) instead of bfloat16: about half (a quarter of) the bytes;
    ``basis_bits`` (None: ``fit_bits``) the same for the code's basis alone. ``fisher``:
    the code minimises the error weighted by the empirical Fisher of what it codes, from the gradients
    :meth:`observe_grad` is given (the sender of an activation receives its gradient;
    :func:`meshnode.compression.transform.fit_transform`).
    """

    def __init__(self, hidden: int, rank: int, ridge: float = 1e-2, sender: int | None = None, code_bits: int = 0,
                 centre: bool = True, fit_bits: int = 16, fisher: bool = False, basis_bits: int | None = None):
        if rank and not centre:
            raise ValueError("a residual map predicts a centred residual: rank > 0 needs centre")
        if not 0 <= rank <= hidden or not (rank or code_bits):
            raise ValueError(f"residual map rank must be in [1, {hidden}] (or 0 with a transform code), got {rank}")
        if not 0 <= code_bits <= MAX_CODE_BITS * hidden:
            raise ValueError(f"mask.reference_code_bits must be in [0, {MAX_CODE_BITS * hidden}] for {hidden} "
                             f"channels, got {code_bits}")
        self.fit_bits, self.basis_bits = _check_fit_bits(fit_bits, basis_bits)
        self.hidden, self.rank, self.ridge, self.code_bits = int(hidden), int(rank), float(ridge), int(code_bits)
        self.fisher = bool(fisher and code_bits)
        self.centre = bool(centre)  # whether what is coded is centred per microbatch (activations; not gradients)
        # names this sender's maps apart from those of other peers of its stage (a receiver may serve several)
        self.sender = int(sender) if sender is not None else secrets.randbits(31)
        self.version = 0
        self.shipped = True  # whether the current version has gone out with a payload
        self.refit_error: str | None = None  # why the last refit kept the current version (None: it did not)
        # version -> MapFit of the last two fits, the current one last: a swarm host attaches the one a payload
        # names, which a refit between the forward and the call must not replace
        self.history: OrderedDict[int, MapFit] = OrderedDict()
        self._reset()

    @property
    def current(self) -> MapFit | None:
        return self.history.get(self.version)  # None before the first fit, or when forget_map left nothing

    @property
    def u(self) -> Tensor | None:
        return None if self.current is None else self.current.u

    @property
    def v(self) -> Tensor | None:
        return None if self.current is None else self.current.v

    @property
    def transform(self) -> Transform | None:
        return None if self.current is None else self.current.transform

    def _reset(self) -> None:
        def zeros():
            return torch.zeros(self.hidden, self.hidden, dtype=torch.float64)

        self.xtx, self.xtr = (zeros(), zeros()) if self.rank else (None, None)
        # the transform code's: sum w x x^T, w x r^T, w r r^T with w = 1 / mean square of the token's residual
        self.wxx, self.wxr = (zeros(), zeros()) if self.rank and self.code_bits else (None, None)
        self.wrr = zeros() if self.code_bits else None
        self.tokens = 0
        self.ggt = zeros() if self.fisher else None  # sum g g^T of the gradients observed (fisher)
        self.grad_tokens = 0

    _STATS = ("xtx", "xtr", "wxx", "wxr", "wrr", "ggt")

    def _settings(self) -> dict:
        return {"hidden": self.hidden, "rank": self.rank, "code_bits": self.code_bits, **_bits_settings(self),
                "fisher": self.fisher, "centre": self.centre}

    def state_dict(self) -> dict:
        """What a resumed run needs to code as the uninterrupted one would (a checkpoint): this sender's id, the fits
        it holds, and the statistics gathered since the last fit."""
        return {
            "settings": self._settings(), "sender": self.sender, "version": self.version, "shipped": self.shipped,
            "history": [[k, _fit_state(f)] for k, f in self.history.items()],
            "stats": {k: getattr(self, k) for k in self._STATS if getattr(self, k) is not None},
            "tokens": self.tokens, "grad_tokens": self.grad_tokens,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; ValueError (nothing changed) if it was written with another width or other
        ``mask.reference_*`` settings."""
        mine = {k for k in self._STATS if getattr(self, k) is not None}
        if state["settings"] != self._settings() or set(state["stats"]) != mine or any(
                tuple(t.shape) != (self.hidden, self.hidden) for t in state["stats"].values()):
            raise ValueError(f"residual map state {state['settings']} does not fit this one {self._settings()}")
        history = OrderedDict((int(k), _fit_from_state(f)) for k, f in state["history"])
        self.sender, self.version, self.shipped = int(state["sender"]), int(state["version"]), bool(state["shipped"])
        self.history = history
        for k, t in state["stats"].items():
            setattr(self, k, t.detach().to("cpu", torch.float64).clone())
        self.tokens, self.grad_tokens = float(state["tokens"]), float(state["grad_tokens"])

    def forget_map(self) -> None:
        """The reference moved (``mask.reference_refresh``): drop the map from every fit held (it predicted the
        residual from the old reference; the transform code stays until the next fit) and the statistics gathered
        against the old reference. A fit that was a map alone goes, and the sender codes without one until it
        refits. The receiver does the same to what it holds (:meth:`MapStore.forget_maps`) at the same step. A fit
        not yet shipped is withdrawn (it was solved against the old reference, and the receiver never held it): the
        sender goes back to the version before it."""
        if not self.shipped and self.version in self.history:
            del self.history[self.version]
            self.version -= 1
        self.history = _without_maps(self.history)
        self.shipped = True  # the receiver holds every version left
        self._reset()

    @torch.no_grad()
    def decay(self, factor: float) -> None:
        """Multiply the statistics gathered since the last fit by ``factor`` in (0, 1] (``mask.reference_fit_decay``,
        once a step that did not refit): the next fit then weighs a step ``a`` steps before it by ``factor ** a``,
        and its ridge and minimum sample count by the weighted token count."""
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"residual map: decay factor must be in (0, 1], got {factor}")
        if factor == 1.0:
            return
        for k in self._STATS:
            t = getattr(self, k)
            if t is not None:
                t.mul_(factor)
        self.tokens *= factor
        self.grad_tokens *= factor

    @torch.no_grad()
    def observe_grad(self, grad: Tensor) -> None:
        """Add the loss's gradient with respect to a microbatch this sender sent (B, T, H) to the Fisher metric
        (``fisher``; otherwise nothing). A non-finite one is skipped."""
        if not self.fisher:
            return
        if grad.shape[-1] != self.hidden:
            raise ValueError(f"residual map: gradient {tuple(grad.shape)} must be (B, T, {self.hidden})")
        g = grad.detach().float().reshape(-1, self.hidden).cpu()
        if bool(torch.isfinite(g).all()):
            self.ggt += (g.T @ g).double()
            self.grad_tokens += g.shape[0]

    @torch.no_grad()
    def observe(self, h_ref: Tensor | None, resid: Tensor) -> None:
        """Add a microbatch: ``h_ref`` (may be None without a map, which does not read it) and the exact residual,
        both (B, T, H)."""
        if resid.shape[-1] != self.hidden or (h_ref is None and self.rank) or (
                h_ref is not None and h_ref.shape != resid.shape):
            raise ValueError(f"residual map: h_ref {None if h_ref is None else tuple(h_ref.shape)} and residual "
                             f"{tuple(resid.shape)} must be (B, T, {self.hidden}) (h_ref None only without a map)")
        # float32 products of one microbatch (on the hot path), summed over microbatches in float64
        r = (_centred_rows(resid) if self.centre else resid.detach().float().reshape(-1, self.hidden)).cpu()
        x = _centred_rows(h_ref).cpu() if self.rank else r
        if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(r).all())):
            return  # a non-finite microbatch teaches the map nothing (its payload is refused elsewhere)
        if self.rank:
            self.xtx += (x.T @ x).double()
            self.xtr += (x.T @ r).double()
        if self.code_bits:
            ms = r.square().mean(-1, keepdim=True)
            w = torch.where(ms > 0, 1.0 / ms, torch.zeros_like(ms))
            self.wrr += ((r * w).T @ r).double()
            if self.rank:
                wx = (x * w).T
                self.wxx += (wx @ x).double()
                self.wxr += (wx @ r).double()
        self.tokens += x.shape[0]

    def _fit_map(self, n: int, xtx: Tensor, xtr: Tensor) -> tuple[Tensor, Tensor] | None:
        sd = (xtx.diagonal() / n).clamp_min(0).sqrt()
        sd = sd.clamp_min(1e-6 * float(sd.max()) + 1e-30)
        std = xtx / sd[:, None] / sd[None, :]
        eye = torch.eye(self.hidden, dtype=torch.float64)
        try:
            a = torch.linalg.solve(std + self.ridge * n * eye, xtr / sd[:, None]) / sd[:, None]
            fitted = a.T @ xtx @ a  # the fitted values' second moment (H, H)
            _, vecs = torch.linalg.eigh((fitted + fitted.T) / 2)
        except torch.linalg.LinAlgError:
            return None
        v = vecs[:, -self.rank:]
        u = a @ v
        if not (bool(torch.isfinite(u).all()) and bool(torch.isfinite(v).all())):
            return None
        return u, v

    @torch.no_grad()
    def refit(self) -> bool:
        """Fit a new version from the statistics since the last fit (then cleared). False (the current map
        stays) with fewer tokens than twice the width, or if the fit is not finite or its code not one a receiver
        takes (:meth:`Transform.check`); ``refit_error`` then says which."""
        n, xtx, xtr, wxx, wxr, wrr = self.tokens, self.xtx, self.xtr, self.wxx, self.wxr, self.wrr
        metric = self.ggt if self.fisher and self.grad_tokens and float(self.ggt.trace()) > 0 else None
        self._reset()
        self.refit_error = None
        if n < 2 * self.hidden:
            self.refit_error = f"{n:.0f} tokens since the last fit, fewer than twice the width ({2 * self.hidden})"
            return False
        u = v = tf = None
        # what travels, when any matrix goes in 8 or 4 bits (else the fit's own tensors)
        wire: dict[str, Tensor] | None = {} if min(self.fit_bits, self.basis_bits) < 16 else None
        if self.rank:
            uv = self._fit_map(n, xtx, xtr)
            if uv is None:
                self.refit_error = "the map's solve failed or is not finite"
                return False
            # rounded as they travel (bfloat16, or 8 or 4 bits per value): both ends use these
            u, v = (_rounded(name, x, wire, self.fit_bits) for name, x in zip(MAP_TENSORS, uv))
        if self.code_bits:
            s = wrr
            if u is not None:  # the second moment of r - x A for the map as rounded: what will be coded
                a = u.double() @ v.double().T
                cross = a.T @ wxr
                s = wrr - cross - cross.T + a.T @ wxx @ a
            try:  # the basis rounded as it travels, the sender's encoder fitted to it; never one a receiver refuses
                tf = fit_transform(s, self.code_bits, metric=metric, round_basis=lambda b: _rounded(
                    CODE_TENSORS[0], b, wire, self.basis_bits, unit=True))
                tf.check(self.hidden, self.fisher)
            except (ValueError, torch.linalg.LinAlgError) as exc:
                self.refit_error = f"transform code: {exc}"
                return False
            if wire is not None:
                wire.update(zip(CODE_TENSORS[1:], (tf.scale, tf.bits)))
        self.version += 1
        self.history[self.version] = MapFit(u, v, tf, wire)
        while len(self.history) > 2:
            self.history.popitem(last=False)
        self.shipped = False
        return True

    def predict(self, h_ref: Tensor) -> Tensor:
        fit = self.current
        return fit.predict(h_ref) if fit is not None else torch.zeros_like(h_ref, dtype=torch.float32)

    def attach(self, payload: EncodedPayload, ship: bool | None = None) -> EncodedPayload:
        """``payload`` naming the current map (none before the first fit) and carrying it when ``ship`` (None:
        if it has not gone out yet, the mesh's rule: one receiver per sender; a swarm host decides per peer)."""
        if self.current is None:
            return payload
        named = dataclasses.replace(payload, meta={**payload.meta, MAP_META: [self.sender, self.version]})
        if ship or (ship is None and not self.shipped):
            self.shipped = True
            return self.with_map(named, self.current)
        return named

    @staticmethod
    def with_map(payload: EncodedPayload, fit: MapFit) -> EncodedPayload:
        """``payload`` (which names a map) carrying the map ``fit`` too."""
        return dataclasses.replace(payload, tensors={**payload.tensors, **fit.tensors()})


class MapStore:
    """The receiver's side of the residual map of one boundary: the maps it was sent, by (sender, version): the
    last ``keep`` versions of each of the last :data:`MAX_MAP_SENDERS` senders."""

    def __init__(self, hidden: int, rank: int, keep: int = 2, code_bits: int = 0, fit_bits: int = 16,
                 fisher: bool = False, basis_bits: int | None = None):
        self.fit_bits, self.basis_bits = _check_fit_bits(fit_bits, basis_bits)
        self.hidden, self.rank, self.keep, self.code_bits = int(hidden), int(rank), int(keep), int(code_bits)
        self.fisher = bool(fisher)  # its codes are Fisher-weighted: unit but not orthogonal bases, larger scales
        self.maps: OrderedDict[tuple[int, int], MapFit] = OrderedDict()

    def take(self, payload: EncodedPayload) -> tuple[EncodedPayload, tuple[int, int] | None]:
        """Split a payload into the codec's own part and the (sender, version) its residual was coded against
        (None: no map), storing a map that travels with it. Raises :class:`PayloadError` for a malformed one."""
        key = payload.meta.get(MAP_META)
        names = MAP_TENSORS + CODE_TENSORS + STEP_TENSORS
        parts = {k: payload.tensors[k] for k in names if k in payload.tensors}
        if key is None:
            if parts:
                raise PayloadError("a payload carrying a residual map must name it")
            return payload, None
        if (not isinstance(key, list) or len(key) != 2 or any(isinstance(x, bool) or not isinstance(x, int)
                                                               for x in key) or key[1] < 1):
            raise PayloadError(f"payload {MAP_META} must be [sender, version >= 1], got {key!r}")
        key = (int(key[0]), int(key[1]))
        if parts:
            self._store(key, self._fit_from(parts))
        meta = {k: val for k, val in payload.meta.items() if k != MAP_META}
        tensors = {k: t for k, t in payload.tensors.items() if k not in names}
        return dataclasses.replace(payload, meta=meta, tensors=tensors), key

    def _fit_from(self, parts: dict[str, Tensor]) -> MapFit:
        # a fit whose map a reference move withdrew (ResidualMap.forget_map) keeps its code: a sender that restored
        # it under a new id (or the state of another chain) sends it so, and codes against it without a map
        mapped = bool(self.rank) and (not self.code_bits or any(k in parts for k in MAP_TENSORS))
        mats = (MAP_TENSORS if mapped else ()) + ((CODE_TENSORS[0],) if self.code_bits else ())
        bits = {n: self.basis_bits if n == CODE_TENSORS[0] else self.fit_bits for n in mats}
        steps = tuple(STEP_TENSORS[MATRIX_TENSORS.index(n)] for n in mats if bits[n] < 16)
        want = set(mats) | set(CODE_TENSORS if self.code_bits else ()) | set(steps)
        if set(parts) != want:
            raise PayloadError(f"payload residual map must carry {sorted(want)}, got {sorted(parts)}")
        dec: dict[str, Tensor] = {}
        for name in mats:
            t = parts[name]
            dtype = {16: MAP_DTYPE, 8: torch.int8, 4: torch.uint8}[bits[name]]
            rows = _wire_rows(self.hidden, bits[name])
            cols = self.rank if name in MAP_TENSORS else t.shape[-1]
            if t.dim() != 2 or tuple(t.shape) != (rows, cols) or t.dtype != dtype:
                raise PayloadError(f"payload fit tensor {name!r} must be {(rows, cols)} {dtype}, got "
                                   f"{(tuple(t.shape), t.dtype)}")
            if bits[name] == 16:
                if not bool(torch.isfinite(t).all()):
                    raise PayloadError(f"payload fit tensor {name!r} has non-finite values")
                dec[name] = t
                continue
            step_name = STEP_TENSORS[MATRIX_TENSORS.index(name)]
            step = parts[step_name]
            if tuple(step.shape) != (cols,) or step.dtype != torch.float32 or not (
                    bool(torch.isfinite(step).all()) and bool((step >= 0).all())):
                raise PayloadError(f"payload fit tensor {step_name!r} must be ({cols},) float32, finite and >= 0")
            dec[name] = _decode_columns(t, step, bits[name], self.hidden)
        u, v = (dec[MAP_TENSORS[0]], dec[MAP_TENSORS[1]]) if mapped else (None, None)
        tf = None
        if self.code_bits:
            tf = Transform(dec[CODE_TENSORS[0]], *(parts[k] for k in CODE_TENSORS[1:]))
            try:
                tf.check(self.hidden, self.fisher)
            except ValueError as exc:
                raise PayloadError(f"payload transform code: {exc}") from None
            if tf.code_bits != self.code_bits:
                raise PayloadError(f"payload transform code has {tf.code_bits} bits per token, this boundary uses "
                                   f"{self.code_bits}")
        return MapFit(u, v, tf, dict(parts) if min(self.fit_bits, self.basis_bits) < 16 else None)

    def _store(self, key: tuple[int, int], fit: MapFit) -> None:
        self.maps[key] = fit
        self.maps.move_to_end(key)
        mine = [k for k in self.maps if k[0] == key[0]]
        for old in sorted(mine)[:-self.keep]:
            del self.maps[old]
        while len({k[0] for k in self.maps}) > MAX_MAP_SENDERS:
            oldest = next(iter(self.maps))[0]
            for k in [k for k in self.maps if k[0] == oldest]:
                del self.maps[k]

    def forget_maps(self) -> None:
        """The reference moved: drop the map from every fit held (as its sender does, :meth:`ResidualMap.forget_map`);
        a fit that was a map alone goes."""
        self.maps = _without_maps(self.maps)

    def get(self, key: tuple[int, int]) -> MapFit:
        held = self.maps.get(key)
        if held is None:
            raise KeyError(f"residual map {key[1]} of sender {key[0]} was never received (a peer that restarted "
                           "since; the sender sends it again)")
        self.maps.move_to_end(key)
        return held

    def predict(self, key: tuple[int, int] | None, h_ref: Tensor) -> Tensor:
        if key is None:
            return torch.zeros_like(h_ref, dtype=torch.float32)
        return self.get(key).predict(h_ref)

    def state_dict(self) -> dict:
        """The maps held, in their order (a checkpoint of the in-process mesh, whose senders do not send again)."""
        return {"settings": self._settings(), "maps": [[a, b, _fit_state(f)] for (a, b), f in self.maps.items()]}

    def _settings(self) -> dict:
        return {"hidden": self.hidden, "rank": self.rank, "code_bits": self.code_bits, **_bits_settings(self),
                "fisher": self.fisher}

    def load_state_dict(self, state: dict) -> None:
        if state["settings"] != self._settings():
            raise ValueError(f"map store state {state['settings']} does not fit this one {self._settings()}")
        self.maps = OrderedDict(((int(a), int(b)), _fit_from_state(f)) for a, b, f in state["maps"])


def _without_maps(fits: OrderedDict) -> OrderedDict:
    """``fits`` (key -> :class:`MapFit`, in order) with no map: each keeps its transform code (and the part of its
    wire tensors that carries it), a fit without one goes."""
    out: OrderedDict = OrderedDict()
    for key, fit in fits.items():
        if fit.transform is None:
            continue
        wire = None if fit.wire is None else {k: t for k, t in fit.wire.items() if k not in MAP_TENSORS and k not in
                                              STEP_TENSORS[:len(MAP_TENSORS)]}
        out[key] = MapFit(None, None, fit.transform, wire)
    return out


def _bits_settings(fits: ResidualMap | MapStore) -> dict:
    """The fit's bits in a checkpoint's settings (``basis_bits`` only where it differs: older states lack it)."""
    return {"fit_bits": fits.fit_bits, **({"basis_bits": fits.basis_bits} if fits.basis_bits != fits.fit_bits else {})}


# ---------------------------------------------------------------------------------------------
# the reference check (``mask.reference_check``): both ends compute the pretrained model alike


CHECK_TENSOR = REF_CHECK_TENSOR  # (n <= MAX_REF_CHECK,) float32


def reference_sample(ref: Tensor, n: int) -> Tensor:
    """``n`` entries of ``ref``, evenly spaced over its flattened elements (the same positions on every device, from
    the shape alone): float32 ``(n,)`` on the CPU."""
    flat = ref.detach().reshape(-1)
    idx = torch.arange(n, dtype=torch.int64) * (flat.numel() - 1) // max(n - 1, 1)
    return flat[idx.to(flat.device)].float().cpu()


def with_check(payload: EncodedPayload, sample: Tensor | None) -> EncodedPayload:
    """``payload`` carrying ``sample``, entries of the reference it was coded against (:func:`reference_sample`;
    None: as it is)."""
    if sample is None:
        return payload
    return dataclasses.replace(payload, tensors={**payload.tensors, CHECK_TENSOR: sample})


def take_check(payload: EncodedPayload, n: int) -> tuple[EncodedPayload, Tensor | None]:
    """Split a payload into the rest and the reference entries it carries (None when ``n = 0``). Raises
    :class:`PayloadError` when it carries none where ``n`` are due, other than ``n``, or non-finite ones."""
    got = payload.tensors.get(CHECK_TENSOR)
    if n <= 0:
        if got is not None:
            raise PayloadError("the payload carries a reference check, which this boundary does not use "
                               "(mask.reference_check = 0)")
        return payload, None
    if got is None:
        raise PayloadError(f"the payload carries no reference check (mask.reference_check = {n})")
    if got.dim() != 1 or got.shape[0] != n or got.dtype != torch.float32 or not bool(torch.isfinite(got).all()):
        raise PayloadError(f"a reference check must be {n} finite float32 values, got {got.dtype} "
                           f"{list(got.shape)}")
    tensors = {k: t for k, t in payload.tensors.items() if k != CHECK_TENSOR}
    return dataclasses.replace(payload, tensors=tensors), got


def reference_difference(mine: Tensor, theirs: Tensor) -> float:
    """The relative root-mean-square difference of two samples of one reference (0 for two zero samples)."""
    mine, theirs = mine.double(), theirs.double()
    scale = max(float(mine.norm()), float(theirs.norm()))
    return float((mine - theirs).norm()) / scale if scale > 0 else 0.0


def map_bytes(hidden: int, rank: int) -> int:
    """Wire bytes of one shipped map (U and V)."""
    return 2 * hidden * rank * MAP_DTYPE.itemsize


__all__ = ["CHECK_TENSOR", "CODE_TENSORS", "FIT_BITS", "MAP_META", "MAP_TENSORS", "MAX_MAP_SENDERS",
           "REFERENCE_MODES", "STEP_TENSORS", "MapFit", "MapStore", "ReferenceModel", "ResidualMap", "apply_map",
           "follower_stages", "map_bytes", "peer_passes", "peer_plan", "reference_difference", "reference_sample",
           "take_check", "with_check"]
