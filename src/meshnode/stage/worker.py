"""The transport-agnostic stage worker: one stage replica's modules, boundary codecs, optimizer and bytes.

A worker takes an input payload and returns an output payload (forward), takes a gradient payload
and returns one (backward), and steps its optimizer. It knows nothing about who sent a payload or
how: ``meshnode.mesh`` wires workers with in-process calls, ``meshnode.node`` with libp2p RPCs. Same
seeds in, same numbers out.

Per microbatch the worker keeps the autograd graph between its received input (a leaf that requires
grad) and its output, until the matching backward arrives. On stage 0 the input is token ids; on the
last stage ``forward`` also takes the labels and returns the loss, and ``backward(mb, None)`` starts
from that loss.

Gradient clipping is per stage (each worker clips its own gradient norm to ``train.grad_clip``): a
global norm would need one more round trip through the pipeline per step. The dense reference uses
the same rule, so every comparison is like for like.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import secrets
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ..compression import (
    BoundaryContext,
    ByteCounter,
    EncodedPayload,
    MaskKey,
    PayloadError,
    make_codec,
    payload_bytes,
    tc_grad,
)
from ..config import RunConfig
from ..model import StageModule
from ..model.precision import use_bf16
from ..optim import MicrobatchNoise, SpectralAdamW
from .reference import (
    CODE_TENSORS,
    MAP_META,
    MAP_TENSORS,
    STEP_TENSORS,
    MapFit,
    MapStore,
    ReferenceModel,
    ResidualMap,
    fits_after,
    reference_difference,
    reference_sample,
    take_check,
    with_check,
)

logger = logging.getLogger(__name__)


class StageError(RuntimeError):
    """A request a worker cannot serve (unknown microbatch, wrong shape); the worker's state is unchanged."""


@dataclass(frozen=True, order=True)
class MicrobatchId:
    """Identifies one microbatch of one optimizer step of one replica chain.

    ``chain`` names the driver the microbatch came from (the swarm; "" in the mesh): a replica serving two
    drivers holds their microbatches with the same (step, index) apart. The mask and codec keys use only
    (step, index), which both ends of a boundary share."""

    step: int
    index: int
    chain: str = ""


@dataclass
class _InFlight:
    inputs: Tensor | None  # the received leaf (B, T, H), None on stage 0
    outputs: Tensor  # output (B, T, H) or the loss on the last stage
    ctx_out: BoundaryContext | None  # the exchange on boundary ``index`` (None on the last stage)
    ctx_in: BoundaryContext | None  # the exchange on boundary ``index - 1`` (None on stage 0)
    tokens: int = 0
    # reference coding (``mask.reference``): the token ids, and the next stage's decoded input (``"both"``)
    ids: Tensor | None = None
    sent: Tensor | None = None


@dataclass
class StepStats:
    loss_sum: float = 0.0
    microbatches: int = 0
    tokens: int = 0
    extra: dict = field(default_factory=dict)


def causal_lm_loss(logits: Tensor, ids: Tensor) -> Tensor:
    """Mean next-token cross entropy: ``logits (B, T, V)`` at t predicts ``ids (B, T)`` at t + 1."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


class StageWorker:
    """One replica of one stage: forward, backward, step, with codecs at its boundaries."""

    def __init__(self, module: StageModule, cfg: RunConfig, *, replica: int = 0, counter: ByteCounter | None = None):
        self.module = module
        self.cfg = cfg
        self.replica = replica
        self.index = module.index
        self.num_stages = module.num_stages
        self.counter = counter if counter is not None else ByteCounter()
        self.codec = make_codec(cfg.mask)
        self.dense_codec = make_codec(_dense_mask_cfg(cfg))
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        t = cfg.train
        self.optimizer = SpectralAdamW(
            named, cfg.spectral, max_staleness=cfg.anchor.max_staleness, lr=t.lr, betas=tuple(t.betas), eps=t.eps,
            weight_decay=t.weight_decay, ema_init=cfg.spectral.ema_init,
        )
        self.noise = MicrobatchNoise(dict(named), cfg.dp.replicas, t.microbatches) if cfg.dp.v_correction else None
        self.in_flight: dict[MicrobatchId, _InFlight] = {}
        self.step_stats = StepStats()
        self.masked = True  # the anchor turns masking off on its own workers
        # ``mask.reference``: the frozen pretrained stages both ends of a boundary compute the reference from
        # (:mod:`.reference`); whoever builds the worker sets it (it needs every stage's pretrained weights)
        self.reference: ReferenceModel | None = None
        # ``mask.reference_map_rank``: the residual map of the boundary this stage sends on, and the maps it was
        # sent for the one it receives on (built at the first microbatch that needs them: they need the width)
        self.map_out: ResidualMap | None = None
        self.map_in: MapStore | None = None
        # ``mask.reference_grad_code_bits``: the transform code of the gradient this stage sends back (a map of rank
        # 0, uncentred), and the codes it was sent for the gradient it receives
        self.gcode_out: ResidualMap | None = None
        self.gcode_in: MapStore | None = None
        # whether forward() ships a new map (backward() a new gradient code) with its next payload (the mesh: one
        # receiver); a swarm host clears it and attaches them itself, per peer
        self.ship_maps = True
        # ``mask.reference_check``: the largest relative difference between a sender's sampled reference and this
        # stage's own (both directions), and the microbatches refused for one above ``mask.reference_tolerance``
        self.ref_mismatch = 0.0
        self.ref_refused = 0
        self.ref_checked = 0  # samples compared

    # ------------------------------------------------------------------------------------------
    # helpers

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def _mask_key(self, mb: MicrobatchId, boundary: int) -> MaskKey:
        return MaskKey(
            run_seed=self.cfg.train.seed, step=mb.step, microbatch=mb.index, boundary=boundary,
            version=self.cfg.mask.version,
        )

    def codec_for(self, step: int):
        """The codec of this step: dense while unmasked (anchor, or inside ``mask.warmup_steps``)."""
        if not self.masked or step < self.cfg.mask.warmup_steps:
            return self.dense_codec
        return self.codec

    def _reference_for(self, codec) -> ReferenceModel | None:
        """The reference model if this step's boundaries are coded against it (never with the dense codec: the
        anchor's unmasked passes, the mask warmup, a run without compression)."""
        if self.cfg.mask.reference == "none" or codec is self.dense_codec:
            return None
        if self.reference is None:
            raise StageError(f"stage {self.index}: mask.reference = {self.cfg.mask.reference!r} needs the pretrained "
                             "reference model, which this worker was not given")
        return self.reference

    def _residual_map(self, hidden: int) -> ResidualMap | None:
        """The residual map of the boundary this stage sends on (``mask.reference_map_rank``), or None."""
        m = self.cfg.mask
        if (m.reference_map_rank or m.reference_code_bits) and self.map_out is None:
            try:
                self.map_out = ResidualMap(hidden, m.reference_map_rank, code_bits=m.reference_code_bits,
                                           fit_bits=m.reference_fit_bits, basis_bits=m.reference_basis_bits,
                                           fisher=m.reference_code_metric == "fisher")
            except ValueError as exc:
                raise StageError(f"stage {self.index}: {exc}") from None
        return self.map_out

    def _take_map(self, payload: EncodedPayload, ref: ReferenceModel | None
                  ) -> tuple[EncodedPayload, MapFit | None]:
        """The codec's part of an incoming activation payload and the residual map it was coded against (None:
        none), storing a map that travels with it."""
        return self._take_fit(payload, ref, "map_in", "residual map")

    def _take_grad_code(self, payload: EncodedPayload, ref: ReferenceModel | None
                        ) -> tuple[EncodedPayload, MapFit | None]:
        """The codec's part of an incoming gradient payload and the transform code it names (None: none)."""
        return self._take_fit(payload, ref, "gcode_in", "gradient code")

    def _check_entries(self, ref: ReferenceModel | None, kind: str) -> int:
        """The sampled reference entries a payload of ``kind`` carries (``mask.reference_check``): an activation's,
        and with ``mask.reference = both`` as many of the reference gradient its sender will add to the gradient it
        gets back (so the receiver checks both ways before anything goes downstream); a gradient payload none."""
        if ref is None or kind != "activation":
            return 0
        return self.cfg.mask.reference_check * (2 if self.cfg.mask.reference == "both" else 1)

    def _take_check(self, payload: EncodedPayload, ref: ReferenceModel | None, kind: str
                    ) -> tuple[EncodedPayload, Tensor | None]:
        """The rest of an incoming payload and the sender's sampled reference it carries (None: none due)."""
        try:
            return take_check(payload, self._check_entries(ref, kind))
        except PayloadError as exc:
            raise StageError(f"stage {self.index}: {exc}") from None

    def _compare_reference(self, theirs: Tensor | None, mine: Tensor, what: str, mb: MicrobatchId) -> None:
        """Refuse the microbatch when the sender's sampled reference ``theirs`` differs from this stage's ``mine`` by
        more than ``mask.reference_tolerance`` (they decode to different tensors); keep the largest difference."""
        if theirs is None:
            return
        own = reference_sample(mine, theirs.shape[0])
        if not bool(torch.isfinite(own).all()):
            raise StageError(f"stage {self.index}: its own {what} reference of microbatch {mb} is not finite (an "
                             "overflow in the frozen model); microbatch refused")
        diff = reference_difference(own, theirs)
        self.ref_checked += 1
        self.ref_mismatch = max(self.ref_mismatch, diff)
        tol = self.cfg.mask.reference_tolerance
        if diff > tol:
            self.ref_refused += 1
            msg = (f"stage {self.index}: the {what} reference of microbatch {mb} differs from its sender's by "
                   f"{diff:.3g} (relative, over {theirs.shape[0]} sampled entries) > mask.reference_tolerance "
                   f"{tol:g}: the two peers compute the pretrained model differently (another device's kernels or "
                   "library), and the payload would decode to another tensor than was sent; microbatch refused")
            if self.ref_refused & (self.ref_refused - 1) == 0:  # the 1st, 2nd, 4th, 8th ... time
                logger.warning("%s (%d so far)", msg, self.ref_refused)
            raise StageError(msg)

    def _take_fit(self, payload: EncodedPayload, ref: ReferenceModel | None, store: str, what: str
                  ) -> tuple[EncodedPayload, MapFit | None]:
        if MAP_META not in payload.meta and not any(k in payload.tensors for k in MAP_TENSORS + CODE_TENSORS
                                                          + STEP_TENSORS):
            return payload, None
        if ref is None or not any(self._fit_sizes(store)):
            raise StageError(f"stage {self.index}: the payload names a {what}, which this boundary does not use")
        held = self._store(store, payload.shape[-1])
        try:
            payload, key = held.take(payload)
            return payload, None if key is None else held.get(key)
        except PayloadError as exc:
            raise StageError(f"stage {self.index}: {exc}") from None
        except KeyError as exc:
            raise StageError(f"stage {self.index}: {what}: {exc.args[0]}") from None

    def _store(self, store: str, hidden: int) -> MapStore:
        """The receiver's fits of one direction (``map_in``: residual maps and codes; ``gcode_in``: gradient
        codes), built on first use."""
        if getattr(self, store) is None:
            m = self.cfg.mask
            rank, bits = self._fit_sizes(store)
            setattr(self, store, MapStore(hidden, rank, code_bits=bits, fit_bits=m.reference_fit_bits,
                                          basis_bits=m.reference_basis_bits,
                                          fisher=store == "map_in" and m.reference_code_metric == "fisher"))
        return getattr(self, store)

    def _fit_sizes(self, store: str) -> tuple[int, int]:
        """(map rank, code bits per token) of what ``store`` receives: ``map_in`` the activation's map and code,
        ``gcode_in`` the gradient's code (no map)."""
        m = self.cfg.mask
        return (m.reference_map_rank, m.reference_code_bits) if store == "map_in" else (0, m.reference_grad_code_bits)

    def fit_state(self) -> dict:
        """Reference coding's fits, both ways (``mask.reference_map_rank``, ``_code_bits``, ``_grad_code_bits``):
        this stage's own maps and codes and those it was sent, for a checkpoint (None where none is built)."""
        return {name: None if getattr(self, name) is None else getattr(self, name).state_dict()
                for name in ("map_out", "map_in", "gcode_out", "gcode_in")}

    def reference_moved(self) -> None:
        """The reference this worker codes against took new weights (``mask.reference_refresh``): drop the residual
        maps both ways (its own, and those it was sent) and the statistics gathered for its next fits; the transform
        codes stay until the next fit (:meth:`ResidualMap.forget_map`). Called between steps, on every worker at
        once."""
        for fit in (self.map_out, self.gcode_out):
            if fit is not None:
                fit.forget_map()
        for held in (self.map_in, self.gcode_in):
            if held is not None:
                held.forget_maps()

    def load_fit_state(self, state: dict, fresh_sender: bool = False) -> None:
        """Restore :meth:`fit_state` (a resumed run codes as the uninterrupted one); ValueError if it does not fit
        this run's settings. ``fresh_sender``: this stage's own fits under a new sender id (a swarm peer, whose
        restored maps must not be taken for what receivers hold of the same id)."""
        for name, st in state.items():
            if st is None:
                setattr(self, name, None)
                continue
            hidden = int(st["settings"]["hidden"])
            if name in ("map_in", "gcode_in"):
                held = self._store(name, hidden)
            else:
                held = self._residual_map(hidden) if name == "map_out" else self._grad_code(hidden)
            if held is None:
                raise ValueError(f"stage {self.index}: the checkpoint holds a {name} this run does not use")
            held.load_state_dict(st)
            if fresh_sender and isinstance(held, ResidualMap):
                held.sender = secrets.randbits(31)

    def partial_step(self) -> dict | None:
        """The step accumulated so far: each parameter's gradient, the step's loss and token sums and the
        gradient-noise tracker's microbatch buffers, or None when no microbatch has been taken back since the last
        step. What a swarm peer's graceful stop checkpoints, so that its restart finishes the step instead of
        losing the microbatches the drivers already counted. Only with nothing in flight (StageError)."""
        if self.in_flight:
            raise StageError(f"stage {self.index}: {len(self.in_flight)} microbatches in flight; a partial step is "
                             "taken between microbatches")
        grads = {n: p.grad.detach().clone() for n, p in self.module.named_parameters() if p.grad is not None}
        if not grads:
            return None
        st = self.step_stats
        return {"grads": grads, "loss_sum": st.loss_sum, "microbatches": st.microbatches, "tokens": st.tokens,
                "noise": None if self.noise is None else self.noise.partial_state()}

    def load_partial_step(self, state: dict) -> None:
        """Restore :meth:`partial_step` onto this stage's weights, in place of any gradient it holds: a gradient for
        a parameter of this stage, of its shape, floating point and finite, for every one given, or nothing
        changes (ValueError)."""
        if self.in_flight:
            raise StageError(f"stage {self.index}: microbatches in flight; a partial step is loaded between them")
        params = dict(self.module.named_parameters())
        grads = state.get("grads")
        if not isinstance(grads, dict) or not grads:
            raise ValueError("a partial step without gradients")
        for n, g in grads.items():
            if n not in params:
                raise ValueError(f"a partial step's gradient for {n!r}, which this stage does not have")
            if (not isinstance(g, Tensor) or not g.is_floating_point() or tuple(g.shape) != tuple(params[n].shape)
                    or not bool(torch.isfinite(g).all())):
                raise ValueError(f"a partial step's gradient for {n!r}: wrong shape or dtype, or not finite")
        try:
            stats = StepStats(float(state["loss_sum"]), int(state["microbatches"]), int(state["tokens"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a partial step's sums: {exc!r}") from None
        if not math.isfinite(stats.loss_sum) or stats.microbatches < 0 or stats.tokens < 0:
            raise ValueError("a partial step's sums are negative or not finite")
        noise = state.get("noise")
        if (noise is None) != (self.noise is None):
            raise ValueError("the partial step was taken with other dp.v_correction settings")
        if self.noise is not None:
            self.noise.check_partial_state(noise)
        self.zero_grad()
        for n, g in grads.items():
            params[n].grad = g.to(device=params[n].device, dtype=params[n].dtype).clone()
        self.step_stats = stats
        if self.noise is not None:
            self.noise.load_partial_state(noise)

    def _grad_code(self, hidden: int) -> ResidualMap | None:
        """The transform code of the gradient this stage sends back (``mask.reference_grad_code_bits``), or None."""
        bits = self.cfg.mask.reference_grad_code_bits
        if bits and self.gcode_out is None:
            try:
                self.gcode_out = ResidualMap(hidden, 0, code_bits=bits, centre=False,
                                             fit_bits=self.cfg.mask.reference_fit_bits,
                                             basis_bits=self.cfg.mask.reference_basis_bits)
            except ValueError as exc:
                raise StageError(f"stage {self.index}: {exc}") from None
        return self.gcode_out

    def _ref_key(self, mb: MicrobatchId) -> tuple:
        return (self.replica, mb)

    def count(self, axis: str, nbytes: int) -> None:
        """Count ``nbytes`` this worker's host sent on ``axis`` (the anchor's on ``anchor``)."""
        self.counter.add(self._axis(axis), nbytes)

    def _axis(self, axis: str) -> str:
        """Traffic of the anchor replica (``replica < 0``) counts on the ``anchor`` axis."""
        return "anchor" if self.replica < 0 else axis

    @property
    def device(self) -> torch.device:
        """Where this stage's module lives (its first parameter's device): decoded inputs and gradients, and the
        token ids, are moved there."""
        return next(self.module.parameters()).device

    @property
    def bf16(self) -> bool:
        """Whether this worker computes under bf16 autocast: ``train.bf16`` for its device (``"auto"``: where bf16 is
        not slower than float32, measured once per process; :mod:`meshnode.model.precision`)."""
        return use_bf16(self.cfg.train.bf16, "cuda" if _on_cuda(self.module) else "cpu")

    def autocast(self):
        if self.bf16:
            return torch.autocast("cpu" if not _on_cuda(self.module) else "cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------------------------------
    # the pipeline surface

    def forward(self, mb: MicrobatchId, inputs: Tensor | EncodedPayload, labels: Tensor | None = None):
        """Run this stage on one microbatch.

        ``inputs``: token ids ``(B, T)`` on stage 0, else the payload from the previous stage.
        Returns the payload for the next stage, or the loss (a float) on the last stage, which needs
        the token ids as ``labels``. With ``mask.reference`` every stage needs them (``labels``; stage 0's are
        its inputs).
        """
        if mb in self.in_flight:
            raise StageError(f"stage {self.index}: microbatch {mb} is already in flight")
        codec = self.codec_for(mb.step)
        ref = self._reference_for(codec)
        ctx_in = None
        device = self.device  # what arrives from the wire is on the CPU; this stage may be on a GPU
        ids = labels = None if labels is None else labels.to(device)
        if self.is_first:
            if not isinstance(inputs, Tensor) or inputs.dim() != 2:
                raise StageError("stage 0 expects token ids (B, T)")
            x = ids = inputs.to(device)
            tokens = x.numel()
        else:
            if not isinstance(inputs, EncodedPayload):
                raise StageError(f"stage {self.index} expects an encoded payload")
            inputs, check = self._take_check(inputs, ref, "activation")
            inputs, fit = self._take_map(inputs, ref)
            ctx_in = BoundaryContext(key=self._mask_key(mb, self.index - 1),
                                     transform=fit.transform if fit is not None else None)
            try:
                x = codec.decode(_payload_on(inputs, device), ctx_in)  # (B, T, H), decoded where the sender did
            except PayloadError as exc:  # another codec's or exchange's payload, a malformed key: refused
                raise StageError(f"stage {self.index}: {exc}") from None
            if ref is not None:
                if ids is None or ids.dim() != 2 or tuple(ids.shape) != tuple(x.shape[:2]):
                    raise StageError(f"stage {self.index}: reference coding needs the microbatch's token ids "
                                     f"{tuple(x.shape[:2])}, got {None if ids is None else tuple(ids.shape)}")
                h_ref = ref.activation(self._ref_key(mb), ids, self.index - 1)
                n = self.cfg.mask.reference_check
                self._compare_reference(None if check is None else check[:n], h_ref, "activation", mb)
                x = x.float() + h_ref
                if fit is not None:
                    x = x + fit.predict(h_ref)
            x = x.to(self._dtype())
            if not bool(torch.isfinite(x).all()):  # every payload tensor is finite: this is an overflow in decoding
                raise StageError(f"stage {self.index}: the decoded input is not finite (a payload or residual map "
                                 "whose finite values overflow); microbatch refused")
            if check is not None and check.shape[0] > self.cfg.mask.reference_check:  # mask.reference = both
                # the reference gradient both ends will take at this input (backward() finds it computed)
                g_ref = ref.input_grad(self._ref_key(mb), ids, self.index - 1, x.detach(),
                                       1.0 / self.cfg.train.microbatches)
                self._compare_reference(check[self.cfg.mask.reference_check:], g_ref, "gradient", mb)
            x = x.requires_grad_(True)
            tokens = x.shape[0] * x.shape[1]
        with self.autocast():
            out = self.module(x)
        if self.is_last:
            if labels is None:
                raise StageError("the last stage needs labels")
            with self.autocast():
                loss = causal_lm_loss(out, labels) / self.cfg.train.microbatches
            self.in_flight[mb] = _InFlight(x if not self.is_first else None, loss, None, ctx_in, tokens, ids)
            self.step_stats.loss_sum += loss.item() * self.cfg.train.microbatches
            self.step_stats.microbatches += 1
            self.step_stats.tokens += tokens
            return loss.item() * self.cfg.train.microbatches
        ctx_out = BoundaryContext(key=self._mask_key(mb, self.index), gain=self.module.next_input_gain)
        sent = None
        if ref is None:
            payload = codec.encode(out.detach(), ctx_out)
        else:
            if ids is None:
                raise StageError(f"stage {self.index}: reference coding needs the microbatch's token ids")
            h_ref = ref.activation(self._ref_key(mb), ids, self.index)
            resid = out.detach().float() - h_ref
            maps = self._residual_map(h_ref.shape[-1])
            pred = maps.predict(h_ref) if maps is not None else None
            ctx_out.transform = maps.transform if maps is not None else None
            payload = codec.encode(resid if pred is None else resid - pred, ctx_out)
            if self.cfg.mask.reference == "both":  # the next stage's input, as it will decode it
                back = codec.decode(payload, BoundaryContext(key=self._mask_key(mb, self.index),
                                                             transform=ctx_out.transform))
                sent = (back.float() + h_ref + (0.0 if pred is None else pred)).to(self._dtype())
            if maps is not None:
                maps.observe(h_ref, resid)
                payload = maps.attach(payload, None if self.ship_maps else False)
            if self._check_entries(ref, "activation"):
                refs = [h_ref]
                if sent is not None:  # the reference gradient it will add to what comes back (backward() reuses it)
                    refs.append(ref.input_grad(self._ref_key(mb), ids, self.index, sent,
                                               1.0 / self.cfg.train.microbatches))
                payload = with_check(payload, torch.cat([reference_sample(r, self.cfg.mask.reference_check)
                                                         for r in refs]))
        self.counter.add(self._axis("pp_fwd"), payload_bytes(payload))
        self.in_flight[mb] = _InFlight(x if not self.is_first else None, out, ctx_out, ctx_in, tokens, ids, sent)
        return payload

    def backward(self, mb: MicrobatchId, grad: EncodedPayload | None = None) -> EncodedPayload | None:
        """Backpropagate one microbatch; returns the gradient payload for the previous stage (None on stage 0)."""
        state = self.in_flight.get(mb)
        if state is None:
            raise StageError(f"stage {self.index}: no forward for microbatch {mb}")
        codec = self.codec_for(mb.step)
        ref = self._reference_for(codec) if self.cfg.mask.reference == "both" else None
        scale = 1.0 / self.cfg.train.microbatches  # the last stage's loss is divided by the microbatches
        if self.is_last:
            state.outputs.backward()
        else:
            if grad is None:
                raise StageError(f"stage {self.index}: backward needs a gradient payload")
            grad, _ = self._take_check(grad, ref, "grad")  # none: the callee checked both ways in forward()
            grad, gfit = self._take_grad_code(grad, ref)
            # the gradient's own transform (or none), never the forward's that the same context carried
            ctx = dataclasses.replace(state.ctx_out, transform=gfit.transform if gfit is not None else None)
            try:
                g = codec.decode_grad(_payload_on(grad, state.outputs.device), ctx)  # (B, T, H)
            except PayloadError as exc:
                raise StageError(f"stage {self.index}: {exc}") from None
            if g.shape != state.outputs.shape:
                raise StageError(
                    f"stage {self.index}: gradient shape {tuple(g.shape)} != {tuple(state.outputs.shape)}"
                )
            if ref is not None:
                g = g.float() + ref.input_grad(self._ref_key(mb), state.ids, self.index, state.sent, scale)
            if self.map_out is not None and codec is not self.dense_codec:
                self.map_out.observe_grad(g)  # the Fisher metric of its code (mask.reference_code_metric)
            if self.cfg.mask.reference_code_grad == "project" and state.ctx_out.transform is not None:
                g = tc_grad(g, state.ctx_out.transform)  # only along what the code sent
            g = g.to(state.outputs.dtype)
            if not bool(torch.isfinite(g).all()):  # before anything reaches the accumulated gradient
                raise StageError(f"stage {self.index}: the decoded gradient is not finite (a payload or code whose "
                                 "finite values overflow); microbatch refused")
            state.outputs.backward(g)
        del self.in_flight[mb]
        if self.noise is not None:
            self.noise.after_microbatch()
        if self.is_first:
            return None
        g_in = state.inputs.grad
        gcode = None
        if ref is not None:
            g_in = g_in.float() - ref.input_grad(self._ref_key(mb), state.ids, self.index - 1,
                                                 state.inputs.detach(), scale)
            gcode = self._grad_code(g_in.shape[-1])
        # the gradient's own transform code (or none): never the forward's, which the same exchange's context holds
        ctx = dataclasses.replace(state.ctx_in, transform=gcode.transform if gcode is not None else None)
        payload = codec.encode_grad(g_in, ctx)
        if gcode is not None:
            gcode.observe(None, g_in)
            payload = gcode.attach(payload, None if self.ship_maps else False)
        self.counter.add(self._axis("pp_bwd"), payload_bytes(payload))
        return payload

    def discard(self, mb: MicrobatchId) -> None:
        """Forget an in-flight microbatch (its peer died); its graph is freed, no gradient is kept."""
        self.in_flight.pop(mb, None)

    def step(self, step: int, lr: float) -> dict:
        """Clip this stage's gradient, apply the optimizer, zero the gradients. Returns step stats (``skipped``:
        the gradient held a non-finite value, from a bad payload or an overflow upstream, and the step was not
        taken: the weights and the optimizer state stay as they were)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        variance = self.noise.variance() if self.noise is not None else {}
        total = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else None
        grad_norm = float(total) if total is not None else float("nan")
        skipped = bool(params) and not math.isfinite(grad_norm)
        if skipped:
            logger.warning("stage %d: gradient norm %s at step %d; step skipped, weights kept", self.index,
                           grad_norm, step)
            if self.noise is not None:
                self.noise.reset()
        else:
            self._apply(params, total, variance, step, lr)
        self.zero_grad()
        if fits_after(step, self.cfg.mask):
            for what, fit in (("residual map", self.map_out), ("gradient code", self.gcode_out)):
                if fit is None:
                    continue
                try:  # after the step: a failed fit keeps the current one and never costs the step
                    if fit.refit():
                        tf = fit.transform
                        code = (f"; code of {tf.code_bits} bits on {tf.basis.shape[1]} directions, largest scale "
                                f"{float(tf.scale.max()) / tf.basis.shape[0] ** 0.5:.3g} sqrt(H)") if tf else ""
                        logger.info("stage %d: %s version %d fitted (%d bytes to send%s)", self.index, what,
                                    fit.version, fit.current.nbytes(), code)
                    else:
                        logger.warning("stage %d: %s not refitted at step %d (%s); keeping version %d", self.index,
                                       what, step, fit.refit_error, fit.version)
                except Exception:
                    logger.exception("stage %d: %s refit failed; keeping version %d", self.index, what, fit.version)
        elif self.cfg.mask.reference_fit_decay < 1.0:  # older steps weigh less in the next fit
            for fit in (self.map_out, self.gcode_out):
                if fit is not None:
                    fit.decay(self.cfg.mask.reference_fit_decay)
        stats = {
            "loss": self.step_stats.loss_sum / max(1, self.step_stats.microbatches),
            "tokens": self.step_stats.tokens,
            "grad_norm": grad_norm,
            "skipped": skipped,
        }
        self.step_stats = StepStats()
        return stats

    def _apply(self, params: list, total: Tensor | None, variance: dict, step: int, lr: float) -> None:
        """Clip to ``train.grad_clip`` by the norm ``total`` already taken, and take the optimizer step."""
        clip = self.cfg.train.grad_clip
        try:
            if params and clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, clip, total)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            if self.noise is not None:
                scale = min(1.0, clip / (float(total) + 1e-6)) if params and clip > 0 else 1.0  # clip_grad_norm_'s
                self.noise.before_step(self.optimizer, variance, scale)
            self.optimizer.step(step)
            if self.noise is not None:
                self.noise.after_step(self.optimizer)
        except BaseException:
            if self.noise is not None:  # the next microbatches start a fresh estimate (their gradients add to these)
                self.noise.reset()
            raise

    def optimizer_state(self) -> dict:
        """The optimizer's state dict, with the second-moment correction's EMAs (``dp.v_correction``)."""
        state = self.optimizer.state_dict()
        return state if self.noise is None else {**state, "noise": self.noise.state_dict()}

    def load_optimizer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
        if self.noise is not None:  # a state without the EMA (saved without the correction) restarts it
            self.noise.load_state_dict(state.get("noise", {"ema_var": {}}))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.noise is not None:
            self.noise.reset()

    def clear_step(self) -> None:
        """Forget the step accumulated so far: the gradients and the step's loss and token sums."""
        self.zero_grad()
        self.step_stats = StepStats()

    # ------------------------------------------------------------------------------------------
    # evaluation (unmasked, no graph)

    @torch.no_grad()
    def eval_forward(self, x: Tensor) -> Tensor:
        with self.autocast():
            return self.module(x if self.is_first else x.to(self._dtype()))

    def _dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype


def _payload_on(payload: EncodedPayload, device: torch.device) -> EncodedPayload:
    """``payload`` with its tensors on ``device`` (what arrives from the wire is on the CPU; a stage on a GPU decodes
    there, as its peer encoded and decoded its own copy there)."""
    if all(t.device == device for t in payload.tensors.values()):
        return payload
    return dataclasses.replace(payload, tensors={k: t.to(device) for k, t in payload.tensors.items()})


def _on_cuda(module: torch.nn.Module) -> bool:
    return next(module.parameters()).is_cuda


def _dense_mask_cfg(cfg: RunConfig):
    import dataclasses

    return dataclasses.replace(cfg.mask, ratio=0.0, codec="dense")


def chain_gradients(
    workers: list[StageWorker], mb: MicrobatchId, ids: Tensor, names: list[list[str]] | list[dict]
) -> list[dict[str, Tensor]]:
    """One in-process forward + backward of ``ids`` through every stage (the anchor's pass, and its masked twin).

    Uses each worker's own codec setting (``worker.masked``). Returns, per stage, float32 copies of the
    gradients of the parameters named in ``names[s]``, and leaves the workers with no gradient and no step stats.
    """
    for w in workers:
        w.zero_grad()
    x = ids
    for w in workers[:-1]:
        x = w.forward(mb, x, labels=ids)
    workers[-1].forward(mb, x, labels=ids)
    grad = None
    for w in reversed(workers):
        grad = w.backward(mb, grad)
    out = []
    for s, w in enumerate(workers):
        params = dict(w.module.named_parameters())
        out.append({n: params[n].grad.detach().float().clone() for n in names[s]})
        w.clear_step()
    return out
