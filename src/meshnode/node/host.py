"""The stage host: one :class:`StageWorker` behind the swarm's RPCs, with its step clock and replay guard.

The fast circuit is a *nested chain* (docs/swarm.md): stage k runs its forward, calls ``rpc_forward``
on a peer of stage k+1 (chosen by :mod:`.routing`) and awaits the reply, which is the gradient of its
output; it then runs its backward and replies upstream with the gradient of its input (the loss
passes through). The last stage computes the loss and starts the backward. If the downstream call
fails, the same payload is re-sent to another peer of stage k+1; nothing of this stage's forward is
redone.

Torch work runs on one thread per host (a single-worker executor), so the worker's compute and its
in-flight table are never touched concurrently; the asyncio loop only moves bytes.

Step clock: a replica steps its optimizer after ``train.microbatches`` completed backward passes,
with the learning rate ``lr_at`` of its own step counter, and only when no microbatch is in flight
on it (an in-place update under a live autograd graph would corrupt that graph). It takes no more than
``train.microbatches`` microbatches per step: the next ones wait at a gate until the step is taken (or,
from a caller, are told "busy" after ``busy_timeout`` and go to another replica), so every step holds
exactly that many microbatches and a stage's replicas take as many steps between them as the drivers.
With one driver and one peer per stage this is exactly the in-process mesh's schedule, so the losses agree.

Replay guard: every (driver, step, microbatch, attempt) is accepted once; a request more than
``limits.replay_window`` driver steps behind the newest one seen from that driver is refused as
stale.
"""

from __future__ import annotations

import asyncio
import io
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..compression import EncodedPayload, payload_bytes
from ..config import RunConfig
from ..errors import brief
from ..optim import lr_at
from ..protocol.limits import WEIGHT_CHUNK_BYTES, Limits
from ..protocol.messages import (
    WireError,
    forward_request,
    parse_backward,
    parse_forward,
    payload_from_wire,
    reply_ok,
    tensor_from_bytes,
    tensor_to_bytes,
)
from ..stage import MicrobatchId, ResidualMap, StageError, StageWorker
from ..stage.reference import MAP_META

logger = logging.getLogger(__name__)

# (stage, request builder for an attempt) -> reply; set by the daemon (routing + retries)
# call_next(stage, build): build(nonce, peer_id) makes the request for the peer it is about to be sent to
NextCall = Callable[[int, Callable[[int, str], dict[str, Any]]], Awaitable[dict[str, Any]]]


_UNCHECKED = object()  # process(): no reference digest to compare (checked before, or none sent)


class BusyError(WireError):
    """The replica is stepping (e.g. in a DP round); the caller should try another peer or retry shortly."""


class StageHost:
    """Serves one stage replica: forward/backward chains, optimizer steps, weights and state for peers."""

    def __init__(
        self, worker: StageWorker, cfg: RunConfig, limits: Limits, run_id: str, *, call_next: NextCall | None = None,
        threads: int = 1, slowdown: float = 1.0,
    ):
        self.worker = worker
        self.cfg = cfg
        self.limits = limits
        self.run_id = run_id
        self.stage = worker.index
        self.num_stages = worker.num_stages
        self.call_next = call_next
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{self.stage}")
        self.opt_step = 0  # optimizer steps taken by this replica
        self.driver_step = 0  # newest driver step seen
        self.last_step_served = -1  # the driver step of the newest microbatch completed here
        self.tokens = 0  # tokens this replica trained on (forward + backward completed)
        self.last_loss: float | None = None
        self.loss_history: deque[float] = deque(maxlen=20)
        self.dp = None  # SwarmDP, set by the daemon
        self.after_step_hooks: list[Callable[[int], Awaitable[None]]] = []
        self._cond = asyncio.Condition()
        self._active = 0
        self._done = 0
        self._step_due = False
        self._stepping = False
        self._closed = False  # leaving (shutdown or a move to another stage): no new microbatch is admitted
        # (driver, step, mb) -> the result of the attempt running now: a retry that arrives meanwhile (the caller's
        # stream was cut) waits for it instead of taking a second place in the step
        self._running: dict[tuple[str, int, int], asyncio.Future] = {}
        # (driver, step, mb) -> (input grad, loss) of the microbatches completed last: a retry of one of them (its
        # reply was lost on the way back, a cut stream) gets this result again; running it again would
        # accumulate its gradient twice and count it twice toward the step
        self._completed: OrderedDict[tuple[str, int, int], tuple[Any, float]] = OrderedDict()
        self._completed_max = max(8, 4 * cfg.train.microbatches)
        self._seen: dict[str, tuple[int, set]] = {}
        self._step_task: asyncio.Task | None = None
        self.busy_timeout = 1.0  # a forward that finds the gate closed longer than this is told "busy"
        # (time, tokens, compute seconds since the previous entry) of each completed microbatch: the served rate
        # (throughput) and the rate while computing (capacity) over a recent horizon
        self._window: deque[tuple[float, int, float]] = deque()
        self._window_compute = 0.0  # compute_s at the last entry
        self.refused = 0
        self.skipped_steps = 0  # optimizer steps not taken: the gradient held a NaN or inf (StageWorker.step)
        self.compute_s = 0.0  # seconds of forward + backward torch work on this host's thread (busy fraction)
        # emulated slower hardware (``meshnode join --slowdown``): each forward / backward holds the host's thread
        # this many times as long as its torch work took (the extra idles, leaving the CPU to other peers)
        self.slowdown = float(slowdown)
        # Optional per-microbatch timing records (``meshnode join --trace-out``): the caller's send and reply
        # times of each call to the next stage, and the serving side's entry and return, on the wall clock.
        self.trace: Callable[[dict[str, Any]], None] | None = None
        # reference coding's residual map (``mask.reference_map_rank``): this host attaches the worker's map to the
        # first payload for each peer of the next stage; peer id -> the map (sender, version) that peer answered for
        self.worker.ship_maps = False
        self._maps_sent: dict[str, tuple[int, int]] = {}
        # the moving reference (mask.reference_refresh with a rank): a SwarmReference, set by the daemon
        self.ref_moves = None

    # ---- helpers ---------------------------------------------------------------------------

    async def run(self, fn, *args):
        """Run torch work on this host's thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _timed(self, fn, *args):
        """Call ``fn`` on the host's thread and add its duration to :attr:`compute_s` (not the queueing); with a
        :attr:`slowdown` above 1, hold the thread for the extra time too (emulation, counted as compute)."""
        t0 = time.perf_counter()
        try:
            out = fn(*args)
            if self.slowdown > 1.0:
                time.sleep((self.slowdown - 1.0) * (time.perf_counter() - t0))
            return out
        finally:
            self.compute_s += time.perf_counter() - t0

    def _trim_window(self, horizon: float) -> float:
        now = time.monotonic()
        while self._window and self._window[0][0] < now - horizon:
            self._window.popleft()
        return now

    def throughput(self, horizon: float = 30.0) -> float:
        """Tokens this replica served per second over the last ``horizon`` seconds: its share of the swarm's
        load (what ``meshnode status`` sums per stage), not how much it could take."""
        now = self._trim_window(horizon)
        if not self._window:
            return 0.0
        span = max(now - self._window[0][0], 1.0)
        return sum(e[1] for e in self._window) / span

    def capacity(self, horizon: float = 30.0) -> float:
        """Tokens per second of this replica's own forward + backward work over the last ``horizon`` seconds
        (0 when unknown): how fast it serves a microbatch, whatever its share of the load. Routing weighs
        peers by this; weighing them by :meth:`throughput` fed back on itself (a replica that happened to get
        more microbatches announced more and was chosen more; 28 vs 52 steps in a tiny DP demo)."""
        self._trim_window(horizon)
        busy = sum(e[2] for e in self._window)
        return sum(e[1] for e in self._window) / busy if busy > 0 else 0.0

    def _check_replay(self, driver: str, step: int, mb: int, attempt: int) -> None:
        newest, seen = self._seen.get(driver, (-1, set()))
        if step < newest - self.limits.replay_window:
            raise WireError(f"stale microbatch: step {step}, newest from this driver {newest}")
        key = (step, mb, attempt)
        if key in seen:
            raise WireError(f"replayed microbatch id (step {step}, mb {mb}, attempt {attempt})")
        if step > newest:
            newest = step
            seen = {k for k in seen if k[0] >= newest - self.limits.replay_window}
        seen.add(key)
        self._seen[driver] = (newest, seen)
        if len(self._seen) > 1024:  # bound the table: forget the least recent drivers
            for d in sorted(self._seen, key=lambda d: self._seen[d][0])[:512]:
                self._seen.pop(d, None)

    # ---- the gate and the step clock -------------------------------------------------------

    def _admits(self) -> bool:
        """The gate is open: not closed (:meth:`close`), no step due or running, and fewer than
        ``train.microbatches`` microbatches taken since the last step. Admitting more (two drivers'
        microbatches in flight at once on one replica) folded them into one step with their gradients summed:
        in a tiny demo with two replicas per stage, a stage's replicas took 63 steps between them where the
        drivers took 80, so their lr schedule and DP clock fell behind and each such step took a double-size
        gradient."""
        return (not self._closed and not self._step_due and not self._stepping
                and self._done + self._active < self.cfg.train.microbatches)

    async def _enter(self, timeout: float | None) -> None:
        """Take a place in the current step, waiting at the gate; after ``timeout`` seconds (None: forever) the
        caller is told "busy" (:class:`BusyError`) and goes to another replica. Waiting and taking the place
        happen under one lock, so a gate that opens for one place lets exactly one waiter in."""
        async with self._cond:
            if not self._admits() and not self._closed:
                if timeout is None:
                    await self._cond.wait_for(lambda: self._admits() or self._closed)
                else:
                    try:
                        await asyncio.wait_for(self._cond.wait_for(lambda: self._admits() or self._closed), timeout)
                    except asyncio.TimeoutError:
                        self.refused += 1
                        raise BusyError("busy: this replica has its step's microbatches or is taking a step; "
                                        "try another peer") from None
            if self._closed:
                self.refused += 1
                raise BusyError("busy: this replica is leaving its stage; try another peer")
            self._active += 1

    async def _leave(self, completed: bool) -> None:
        async with self._cond:
            self._active -= 1
            if completed:
                self._done += 1
                if self._done >= self.cfg.train.microbatches:
                    self._step_due = True
            self._cond.notify_all()  # a microbatch that did not complete frees its place in the step
            if self._step_due and self._active == 0 and not self._stepping:
                self._stepping = True
                # after the reply: a DP round may wait for partners, and they may need our upstream's next step
                self._step_task = asyncio.create_task(self._run_step())

    async def _run_step(self) -> None:
        try:
            await self._step()
        except Exception as exc:
            logger.error("optimizer step %d failed: %r", self.opt_step, exc, exc_info=True)
        finally:
            async with self._cond:
                self._stepping = False
                self._step_due = False
                self._done = 0
                self._cond.notify_all()

    async def run_if_idle(self, work: Callable[[], Awaitable[None]]) -> bool:
        """Run ``work`` now with the gate closed, if this replica is idle (no microbatch in flight, no step due or
        running: no live autograd graph that an in-place weight change could break); False, doing nothing, if
        it is not. What the overlapped DP schedule uses to apply a finished sync without waiting for the next
        step boundary, which after a run's last step never comes."""
        async with self._cond:
            if not self._quiet() or self._closed:
                return False
            self._stepping = True
        try:
            await work()
            return True
        finally:
            async with self._cond:
                self._stepping = False
                self._cond.notify_all()

    async def wake(self) -> None:
        """Wake whoever waits on this replica's state: a background DP round ended (applied, or failed and dropped),
        so a periodic checkpoint waiting for none to be pending looks again instead of waiting out its time."""
        async with self._cond:
            self._cond.notify_all()

    def busy(self) -> bool:
        """A microbatch in flight, an optimizer step (with its blocking DP sync) running, or a background DP sync
        not finished: what a reader of the final counters (the demo) waits out."""
        return not self._quiet() or bool(self.dp is not None and self.dp.pending)

    def _quiet(self) -> bool:
        """No microbatch in flight and no optimizer step due or running."""
        return self._active == 0 and not self._stepping and not self._step_due

    @property
    def pending_microbatches(self) -> int:
        """Microbatches taken into the current step (completed, their gradient accumulated) and not yet applied."""
        return self._done

    def gate_closed(self) -> bool:
        return not self._admits()

    async def _step(self) -> None:
        t = self.cfg.train
        lr = lr_at(self.opt_step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
        stats = await self.run(self.worker.step, self.opt_step, lr)
        self.opt_step += 1
        if stats.get("skipped"):  # a non-finite gradient: the weights were kept (the record and status show it)
            self.skipped_steps += 1
        if self.worker.is_last:
            self.last_loss = float(stats["loss"])
            self.loss_history.append(self.last_loss)
        for hook in self.after_step_hooks:
            try:
                await hook(self.opt_step)
            except Exception as exc:  # a failed DP round must not stop the fast circuit
                logger.warning("after-step hook failed at step %d: %r", self.opt_step, exc)

    async def close(self) -> None:
        """Admit no new microbatch (shutdown, or a move to another stage): callers waiting at the gate and later
        ones are told "busy" and go to another replica; what is in flight finishes (:meth:`wait_idle`). A retry
        of a microbatch this replica completed or is running is still answered (it takes no place)."""
        async with self._cond:
            self._closed = True
            self._cond.notify_all()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is in flight and no step is running (shutdown; after :meth:`close`, nothing new
        comes in meanwhile); False on timeout."""
        async def idle():
            async with self._cond:
                await self._cond.wait_for(lambda: self._active == 0 and not self._stepping)

        try:
            await asyncio.wait_for(idle(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # ---- the chain -------------------------------------------------------------------------

    async def process(
        self, *, driver: str, step: int, mb: int, attempt: int, inputs: torch.Tensor | EncodedPayload,
        labels: torch.Tensor, admit_timeout: float | None = None, reference: object = _UNCHECKED,
    ) -> tuple[EncodedPayload | None, float]:
        """Forward this microbatch, send it on (or compute the loss), backward; returns (input grad, loss).

        A retry (same driver, step and microbatch, another attempt) of one completed here gets the same result
        again, and one of an attempt still running here waits for that attempt's result: either way without a
        place in the step, so its gradient is accumulated and counted once. ``admit_timeout``: how long to wait
        at a closed gate before :class:`BusyError` (None: as long as it takes; the driver's own stage 0).
        ``reference``: the digest of the reference the caller coded against, compared with this peer's once its
        reference is at the microbatch's version (a moving reference: :mod:`.refmoves`)."""
        key = (driver, step, mb)
        while True:
            done = self._completed.get(key)
            if done is not None:
                return done
            running = self._running.get(key)
            if running is None:
                break
            try:
                return await asyncio.shield(running)
            except asyncio.CancelledError:
                if not running.cancelled():
                    raise  # this call was cancelled, not the attempt it waited for
            except BusyError:
                raise  # the first attempt found the gate closed for busy_timeout: so would this one
            except Exception:  # the first attempt failed: this one runs afresh
                pass
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # read by no one: not logged as lost
        self._running[key] = fut
        try:
            result = await self._serve(driver, step, mb, inputs, labels, admit_timeout, reference)
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except BaseException as exc:
            fut.set_exception(exc)
            raise
        else:
            fut.set_result(result)
            return result
        finally:
            self._running.pop(key, None)

    async def _serve(
        self, driver: str, step: int, mb: int, inputs: torch.Tensor | EncodedPayload, labels: torch.Tensor,
        admit_timeout: float | None, reference: object = _UNCHECKED,
    ) -> tuple[EncodedPayload | None, float]:
        await self._enter(admit_timeout)
        completed = False
        mbid = MicrobatchId(step, mb, driver)  # two drivers' same (step, mb) are two microbatches in flight
        try:
            if self.ref_moves is not None:  # the reference at this step's version before anything uses it
                await self.ref_moves.at_step(step, driver)
            if reference is not _UNCHECKED and reference != self._boundary_digest(self.stage - 1):
                raise WireError(self._reference_mismatch(reference))
            try:
                # inside the try: a call cancelled while the forward runs on the thread still leaves its graph in
                # flight there, which the discard (queued behind it on the same thread) frees
                # every stage gets the token ids: the last for its loss, all for ``mask.reference``
                out = await self.run(self._timed, self.worker.forward, mbid, inputs, labels)
                if self.worker.is_last:
                    loss = float(out)
                    grad_out = None
                else:
                    if self.call_next is None:
                        raise StageError("this host has no route to the next stage")
                    vocab = self.limits.vocab
                    map_key = out.meta.get(MAP_META)
                    map_key = tuple(map_key) if map_key is not None else None
                    tried: list[str] = []  # the peers this call went to, in order (the last one answered)

                    def build(attempt_next: int, peer_id: str, out=out) -> dict[str, Any]:
                        tried.append(peer_id)
                        if map_key is not None and self._maps_sent.get(peer_id) != map_key:
                            out = self._with_map(out, map_key)  # this peer has not got the map yet
                        held = self.worker.gcode_in
                        return forward_request(
                            run=self.run_id, driver=driver, step=step, mb=mb, attempt=attempt_next,
                            boundary=self.stage, mask_version=self.cfg.mask.version, payload=out, labels=labels,
                            vocab=vocab, held_codes=list(held.maps) if held is not None else None,
                            reference=self._boundary_digest(self.stage),
                        )

                    t_call = time.time()
                    try:
                        reply = await self.call_next(self.stage + 1, build)
                    finally:
                        # a peer that failed a call may have lost its maps (it refuses one it never received after
                        # a restart): it gets the map again with its next request
                        for peer_id in tried:
                            self._maps_sent.pop(peer_id, None)
                    if map_key is not None and tried:
                        self._maps_sent[tried[-1]] = map_key
                    if self.trace is not None:
                        self.trace({"kind": "call", "stage": self.stage, "driver": driver, "step": step, "mb": mb,
                                    "t_call": t_call, "t_back": time.time(), "bytes": payload_bytes(out)})
                    loss = float(reply["loss"])
                    grad_out = payload_from_wire(reply.get("payload"), self.limits, "grad")
                grad_in = await self.run(self._timed, self.worker.backward, mbid, grad_out)
            except BaseException:
                await self.run(self.worker.discard, mbid)
                raise
            completed = True
            self.last_step_served = max(self.last_step_served, step)
            self._completed[(driver, step, mb)] = (grad_in, loss)
            while len(self._completed) > self._completed_max:
                self._completed.popitem(last=False)
            ntok = int(labels.numel())
            self.tokens += ntok
            self._window.append((time.monotonic(), ntok, self.compute_s - self._window_compute))
            self._window_compute = self.compute_s
            return grad_in, loss
        finally:
            # shielded: a call cancelled while _leave waits for the condition's lock would keep its place forever
            # (the replica would never step again)
            await asyncio.shield(self._leave(completed))

    @property
    def reference_digest(self) -> str | None:
        """Reference coding (``mask.reference``): the digest of the frozen model this peer codes against, which
        each forward request carries and the next stage checks against its own (None: no reference). Computed
        once (a hash of every weight: about a second for SmolLM2-135M; the daemon takes it while building)."""
        ref = self.worker.reference
        return ref.digest if ref is not None else None

    def _boundary_digest(self, boundary: int) -> str | None:
        """What a forward request on ``boundary`` names: the reference digest, or with a moving reference the digest
        of the stages both ends of the boundary compute (:meth:`.refmoves.SwarmReference.boundary_digest`)."""
        if self.ref_moves is not None:
            return self.ref_moves.boundary_digest(boundary)
        return self.reference_digest

    def _reference_mismatch(self, theirs: str | None) -> str:
        mine = self._boundary_digest(self.stage - 1)
        if mine is None:
            return (f"the caller codes against a reference model ({theirs}) and this peer against none: the peers' "
                    "mask.reference differs")
        if theirs is None:
            return ("the caller codes against no reference model (its mask.reference differs, or it runs an older "
                    f"meshnode) and this peer against {mine}")
        if self.ref_moves is not None:
            return (f"the caller's reference model {theirs} is not this peer's {mine} at reference version "
                    f"{self.worker.reference.versions}: they started from different weights or applied different "
                    "moves (a peer that joined after the first move cannot follow them yet)")
        return (f"the caller's reference model {theirs} is not this peer's {mine}: they hold different pretrained "
                "weights, and a payload coded against one decodes wrong against the other")

    def _with_map(self, payload: EncodedPayload, key: tuple) -> EncodedPayload:
        """``payload`` carrying the residual map it names (its bytes count on the forward axis)."""
        return self._attach_fit(payload, self.worker.map_out, key, "pp_fwd", "residual map", StageError)

    def _with_grad_code(self, grad: EncodedPayload | None, held: set[tuple[int, int]]) -> EncodedPayload | None:
        """``grad`` carrying the gradient transform code it names when the caller does not hold it (its bytes count on
        the backward axis): the caller says what it holds in each request, so a restarted one gets it again."""
        code = self.worker.gcode_out
        key = grad.meta.get(MAP_META) if grad is not None else None
        if key is None or code is None or tuple(key) in held:
            return grad
        return self._attach_fit(grad, code, key, "pp_bwd", "gradient code", WireError)

    def _attach_fit(self, payload: EncodedPayload, fits: ResidualMap | None, key, axis: str, what: str,
                    error: type[Exception]) -> EncodedPayload:
        """``payload`` carrying version ``key[1]`` of ``fits`` (its bytes counted on ``axis``); ``error`` if that
        version is no longer held."""
        fit = fits.history.get(key[1]) if fits is not None else None
        if fit is None:
            raise error(f"{what} {key[1]} is no longer held")
        if key[1] == fits.version:
            fits.shipped = True  # gone out: a reference move keeps it (ResidualMap.forget_map), as in the mesh
        self.worker.count(axis, fit.nbytes())
        return ResidualMap.with_map(payload, fit)

    # ---- the StageBackend surface ----------------------------------------------------------

    async def forward(self, request: dict[str, Any]) -> dict[str, Any]:
        t_in = time.time()
        if self.stage == 0:
            raise WireError("stage 0 takes no forward requests (it is fed by its driver)")
        req = parse_forward(request, self.limits, run=self.run_id, stage=self.stage,
                            mask_version=self.cfg.mask.version)
        moving = self.ref_moves is not None  # compared once this peer's reference is at the step's version
        if not moving and req.reference != self.reference_digest:
            raise WireError(self._reference_mismatch(req.reference))
        self._check_replay(req.driver, req.step, req.mb, req.attempt)
        self.driver_step = max(self.driver_step, req.step)
        try:
            # a retry that reaches the replica that holds or completed its microbatch is answered there, never
            # told "busy" (a caller asks the same peer again after a cut stream); one that goes to another
            # replica is computed there and counted twice (the caller cannot tell a lost reply from a lost request)
            grad_in, loss = await self.process(
                driver=req.driver, step=req.step, mb=req.mb, attempt=req.attempt, inputs=req.payload,
                labels=req.labels, admit_timeout=self.busy_timeout,
                **({"reference": req.reference} if moving else {}),
            )
        except StageError as exc:
            raise WireError(str(exc)) from None
        grad_in = self._with_grad_code(grad_in, req.held_codes)
        if self.trace is not None:
            self.trace({"kind": "serve", "stage": self.stage, "driver": req.driver, "step": req.step, "mb": req.mb,
                        "t_in": t_in, "t_out": time.time(), "bytes": payload_bytes(grad_in) if grad_in else 0})
        return reply_ok(loss=loss, payload=grad_in)

    async def backward(self, request: dict[str, Any]) -> dict[str, Any]:
        """Gradients travel in ``rpc_forward`` replies (nested chain); a stand-alone backward is validated and
        refused unless this peer holds the microbatch's forward."""
        req = parse_backward(request, self.limits, run=self.run_id, stage=self.stage)
        self._check_replay(req.driver, req.step, req.mb, req.attempt)
        mbid = MicrobatchId(req.step, req.mb, req.driver)
        if mbid not in self.worker.in_flight:
            raise WireError(f"no forward of microbatch (step {req.step}, mb {req.mb}) is held by this peer")
        raise WireError("microbatch is owned by a running chain; its gradient comes in the rpc_forward reply")

    async def reference_move(self, request: dict[str, Any], sender: str) -> dict[str, Any]:
        """``rpc_reference_move``: another stage's reference move (:mod:`.refmoves`)."""
        if self.ref_moves is None:
            raise WireError("this peer's reference does not move (mask.reference_refresh differs)")
        if "fetch" in request:  # [stage, version]: a peer that missed a push asks for the move
            want = request["fetch"]
            if (request.get("run") != self.run_id or not isinstance(want, list) or len(want) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in want)):
                raise WireError("reference move fetch: expected run and fetch = [stage, version]")
            return {"ok": True, **(await self.ref_moves.held_move(*want))}
        return await self.ref_moves.receive(request, sender)

    def info(self) -> dict[str, Any]:
        return {
            "run": self.run_id, "stage": self.stage, "num_stages": self.num_stages, "opt_step": self.opt_step,
            "driver_step": self.driver_step, "tokens": self.tokens, "bytes": self.worker.counter.snapshot(),
            "loss": self.last_loss, "refused": self.refused,
            "ref_mismatch": self.worker.ref_mismatch, "ref_refused": self.worker.ref_refused,
        }

    # ---- weights and state for peers -------------------------------------------------------

    def _weights_snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.worker.module.state_dict().items()}

    def _outer_snapshot(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        outer = self.dp.outer
        keep = set(outer.start) if names is None else set(names)
        return {**{f"start/{n}": t.clone() for n, t in outer.start.items() if n in keep},
                **{f"velocity/{n}": t.clone() for n, t in outer.velocity.items() if n in keep}}

    async def weights_stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The stage's current weights as chunks of ``{name: [dtype, shape, bytes]}`` (float32, or bf16 on request).

        ``what = "outer"``: the DP outer state instead (``start/<name>``, ``velocity/<name>``), where a follower
        of the DP log (:class:`~.dp.DPFollower`) starts from; ``dp_seq`` and ``dp_epoch`` say which log entry
        it corresponds to.

        ``names`` (with ``what = "outer"``): only those tensors' start and velocity, what a stage partner takes
        when its start weights drifted from this peer's (:meth:`~.dp.SwarmDP._realign`). Served at once, also
        while this peer steps: the outer state changes only on the host's thread, where the copy is made, so
        each tensor is whole; a partner in the middle of its own DP sync (blocking schedule) would otherwise keep
        the caller waiting until its rounds time out. No ``dp_seq``: the copy need not match a log entry."""
        if request.get("run") != self.run_id:
            raise WireError(f"weights request for run {request.get('run')!r}")
        outer = request.get("what") == "outer"
        if outer and self.dp is None:
            raise WireError("outer state requested from a peer without DP")
        names = request.get("names")
        if names is not None:
            if not outer:
                raise WireError("weights request: names only with what = outer")
            known = self.dp.outer.start
            if (not isinstance(names, list) or not names or len(names) > len(known)
                    or not all(isinstance(n, str) and n in known for n in names)):
                raise WireError("outer state request: names must be a non-empty list of this stage's parameters")
            weights = await self.run(self._outer_snapshot, names)
            for chunk in tensor_chunks(weights, half=request.get("dtype") == "bfloat16"):
                yield {**chunk, "opt_step": self.opt_step}
            return
        async with self._cond:  # between steps: a consistent snapshot
            await self._cond.wait_for(lambda: not self._stepping)
            weights = await self.run(self._outer_snapshot if outer else self._weights_snapshot)
            meta = {"opt_step": self.opt_step, "driver_step": self.driver_step, "dp_syncs": self.dp_syncs()}
            if self.dp is not None:
                meta.update(dp_seq=self.dp.log_seq, dp_epoch=self.dp.log_epoch)
        for chunk in tensor_chunks(weights, half=request.get("dtype") == "bfloat16"):
            yield {**chunk, **meta}

    async def dp_log_stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The DP log after ``since`` (:meth:`~.dp.SwarmDP.log_since`): per entry, chunks of its tensors
        (``p/<name>``, ``q/<name>``, fp16) tagged with ``seq`` and ``fragment``; ``gap = true`` when the
        requested entries cannot be replayed (the caller then loads the outer state)."""
        if request.get("run") != self.run_id:
            raise WireError(f"DP log request for run {request.get('run')!r}")
        since, epoch = request.get("since"), request.get("epoch")
        if not isinstance(since, int) or isinstance(since, bool) or since < 0:
            raise WireError("DP log request: since must be an integer >= 0")
        if epoch is not None and not (isinstance(epoch, str) and len(epoch) <= 64):
            raise WireError("DP log request: epoch must be a short string or null")
        if self.dp is None:
            raise WireError("DP log requested from a peer without DP")
        async with self._cond:  # between steps: the log and the step agree
            await self._cond.wait_for(lambda: not self._stepping)
            entries = self.dp.log_since(since, epoch)
            meta = {"opt_step": self.opt_step, "dp_seq": self.dp.log_seq, "dp_epoch": self.dp.log_epoch}
        if not entries:
            yield {"ok": True, "pieces": [], "gap": entries is None, "last": True, **meta}
            return
        for i, entry in enumerate(entries):
            for chunk in tensor_chunks(entry.tensors()):
                yield {**chunk, "seq": entry.seq, "fragment": entry.fragment, "gap": False,
                       "last": chunk["last"] and i == len(entries) - 1, **meta}

    def dp_syncs(self) -> int:
        return 0 if self.dp is None else self.dp.syncs

    def _state_blob(self, partial: bool = False) -> bytes:
        buf = io.BytesIO()
        state = {
            "weights": self._weights_snapshot(), "optimizer": self.worker.optimizer_state(),
            "opt_step": self.opt_step, "driver_step": self.driver_step,
            "dp": None if self.dp is None else self.dp.state_dict(),
            # reference coding: this stage's own maps and codes (not those it was sent: their senders send again)
            "fits": {k: v for k, v in self.worker.fit_state().items() if k in ("map_out", "gcode_out")},
        }
        if self.ref_moves is not None:  # the moving reference: every move applied and held (not sent again)
            state["reference_moves"] = self.ref_moves.state_dict()
        if partial and (step := self.worker.partial_step()) is not None:
            state["partial"] = {"done": self._done, **step}
        torch.save(state, buf)
        return buf.getvalue()

    async def state_blob(self, partial: bool = False) -> bytes:
        """Weights, optimizer, step counters and DP state as one ``torch.save`` blob, taken between steps (what a
        joining peer fetches and a checkpoint holds). ``partial``: with the step accumulated so far (the
        microbatches this replica took since its last step: their gradients and count), for the checkpoint of a
        graceful stop; only once the gate is closed (:meth:`close`) and nothing is in flight, which it waits for.
        A joining peer is never given it: its microbatches were this replica's, and counting them in another would
        count them twice."""
        if partial and not self._closed:
            raise RuntimeError("a state with the partial step is taken after close()")
        async with self._cond:
            await self._cond.wait_for(lambda: not self._stepping and not (partial and self._active))
            return await self.run(self._state_blob, partial)

    async def checkpoint_blob(self, idle_wait: float) -> tuple[bytes, int] | None:
        """A periodic checkpoint's state (the gate stays open): with the step taken so far if the replica is quiet
        (nothing in flight, no step due or running, no overlapped DP round pending) within ``idle_wait`` seconds,
        else between steps without it. Returns the blob and the microbatches of the partial step it holds; None when
        a DP round is pending then (its error feedback is committed before its update reaches the weights: a state
        taken in between would lose that update on a resume). Taken under the gate's lock, so no microbatch enters
        (:meth:`_enter` takes the lock) between the check and the copy."""
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self._quiet() and not self._dp_busy()), idle_wait)
                quiet = True
            except asyncio.TimeoutError:  # the condition's wait takes the lock back before this is raised
                quiet = False
                await self._cond.wait_for(lambda: not self._stepping)
                if self._dp_busy():
                    return None
            # (a call cancelled during its backward may have left a gradient with no microbatch counted: not a step)
            partial = quiet and self._done > 0
            return await self.run(self._state_blob, partial), self._done if partial else 0

    def _dp_busy(self) -> bool:
        return self.dp is not None and bool(self.dp.pending or self.dp.ready)

    async def state_stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Weights + optimizer + DP state (torch.save bytes, loaded with ``weights_only=True``) in chunks."""
        if request.get("run") != self.run_id:
            raise WireError(f"state request for run {request.get('run')!r}")
        blob = await self.state_blob()
        n = max(1, -(-len(blob) // WEIGHT_CHUNK_BYTES))
        for i in range(n):
            yield {"ok": True, "data": blob[i * WEIGHT_CHUNK_BYTES : (i + 1) * WEIGHT_CHUNK_BYTES], "last": i == n - 1,
                   "opt_step": self.opt_step}

    def _check_weights(self, weights: Any) -> None:
        """ValueError unless ``weights`` holds every tensor of the stage's module, of its shape, floating point and
        finite, and nothing else."""
        own = self.worker.module.state_dict()
        if not isinstance(weights, dict) or set(weights) != set(own):
            names = set(weights) if isinstance(weights, dict) else set()
            missing, extra = sorted(set(own) - names), sorted(names - set(own))
            raise ValueError(f"weights do not fit the stage (missing {missing[:3]}, unknown {extra[:3]})")
        for name, t in weights.items():
            if (not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(own[name].shape)
                    or not t.is_floating_point() or not bool(torch.isfinite(t).all())):
                raise ValueError(f"weights {name!r}: wrong shape or dtype, or non-finite values")

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor], opt_step: int) -> None:
        """The stage's weights from elsewhere without an optimizer state (an anchor's copy): every tensor of the
        module, of its shape and finite, or nothing changes (ValueError). The optimizer step goes on from
        ``opt_step`` (the lr schedule); DP restarts from these weights."""
        self._check_weights(weights)
        own = self.worker.module.state_dict()
        self.worker.module.load_state_dict({n: t.to(own[n].dtype) for n, t in weights.items()})
        self.opt_step = int(opt_step)
        if self.dp is not None:
            self.dp.restart_from_weights()

    def load_state_blob(self, blob: bytes, partial: bool = False, chain: bool = True) -> int:
        """Load a :meth:`state_blob` (before serving: no microbatch in flight). Any step this replica had
        accumulated is dropped (its gradients were of the weights replaced); ``partial`` (this peer's own
        checkpoint) restores the blob's partial step instead, if it has one and it fits this run (else it is
        dropped with a warning). Returns the microbatches of the step restored. ``chain`` false: the blob is a
        peer's of another replica chain (fixed routes), whose reference moves and fits are its chain's, not this
        peer's: only the rest is loaded.

        A blob that is not a state of this stage (damaged, truncated, another model's shapes, non-finite values, an
        optimizer or DP state that does not load) is a ValueError, and the replica keeps its own state whole: what
        can be checked is checked first, and a load that fails half-way is undone from a copy taken before it (with
        the step accumulated so far)."""
        state = _read_state_blob(blob)
        self._check_weights(state["weights"])
        if not chain:
            state = {k: v for k, v in state.items() if k not in ("fits", "reference_moves")}
        backup = self._state_blob(partial=True)
        try:
            return self._apply_state(state, partial)
        except Exception as exc:  # noqa: BLE001 (any part of the state refused: undo the parts already loaded)
            self._apply_state(_read_state_blob(backup), True)
            raise ValueError(f"stage {self.stage}: the state does not load ({brief(exc)}); this "
                             "replica's own state is kept") from None

    def _apply_state(self, state: dict[str, Any], partial: bool) -> int:
        self.worker.clear_step()
        self._done = 0
        self.worker.module.load_state_dict(state["weights"])
        self.worker.load_optimizer_state(state["optimizer"])
        self.opt_step = int(state["opt_step"])
        self.driver_step = int(state["driver_step"])
        if self.dp is not None and state.get("dp") is not None:
            self.dp.load_state_dict(state["dp"])
        fits = False
        if state.get("fits"):
            try:  # under a new sender id: receivers that hold the old one's maps are sent these afresh
                self.worker.load_fit_state(state["fits"], fresh_sender=True)
                fits = True
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("stage %d: the state's reference maps and codes do not fit this run (%s); they are "
                               "fitted again", self.stage, exc)
        if self.ref_moves is not None and state.get("reference_moves") is not None:
            # last: what fails before it changed nothing; the fits restored were made after these moves
            self.ref_moves.load_state_dict(state["reference_moves"], fits_restored=fits)
        return self._load_partial(state.get("partial")) if partial else 0

    def _load_partial(self, partial: Any) -> int:
        if partial is None:
            return 0
        m = self.cfg.train.microbatches
        try:
            done = int(partial["done"])
            if not 0 < done < m:
                raise ValueError(f"{done} microbatches taken, where a step takes {m}")
            self.worker.load_partial_step(partial)
        except (KeyError, TypeError, ValueError, StageError) as exc:
            logger.warning("stage %d: the checkpoint's partial step does not fit this run (%s); its microbatches are "
                           "dropped", self.stage, exc)
            return 0
        self._done = done
        return done


def _read_state_blob(blob: bytes) -> dict[str, Any]:
    """The dict of a :meth:`StageHost.state_blob`; ValueError if ``blob`` is not one (truncated, not a torch.save
    of tensors and plain values, fields missing, step counters that are not counts, a non-finite optimizer or DP
    tensor)."""
    try:
        state = torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as exc:  # noqa: BLE001 (torch.load's errors have no common base)
        raise ValueError(f"not a stage state ({brief(exc)})") from None
    if not isinstance(state, dict) or not {"weights", "optimizer", "opt_step", "driver_step"} <= set(state):
        raise ValueError("not a stage state (fields missing)")
    for key in ("opt_step", "driver_step"):
        if isinstance(state[key], bool) or not isinstance(state[key], int) or state[key] < 0:
            raise ValueError(f"a stage state's {key} is {state[key]!r}, not a count")
    for key in ("optimizer", "dp"):
        if not _all_finite(state.get(key)):
            raise ValueError(f"a stage state's {key} state holds non-finite values")
    return state


def _all_finite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, dict):
        return all(_all_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_all_finite(v) for v in value)
    return not isinstance(value, float) or math.isfinite(value)


# a state blob's bound per parameter: weights, AdamW's two moments, DP's start, velocity and error feedback, the
# spectral prior's EMA and dp.v_correction's estimate (float32 each: about 28 bytes), with twice the room
STATE_BYTES_PER_PARAM = 64
STATE_BYTES_SLACK = 64 << 20  # reference coding's fits (16 MB for SmolLM2), counters, pickling


def state_bytes_bound(module: torch.nn.Module) -> int:
    """The most a peer's state blob of this stage may take (:meth:`StageHost.state_blob`): a joining peer refuses a
    larger one as it arrives instead of holding whatever a peer streams."""
    return STATE_BYTES_PER_PARAM * sum(p.numel() for p in module.parameters()) + STATE_BYTES_SLACK


def state_chunk_bytes(frame: dict[str, Any]) -> int:
    """The size of one ``rpc_get_state`` frame's ``data`` (``collect_stream``'s ``size``, bounded by
    :func:`state_bytes_bound`); ValueError for a frame without bytes."""
    data = frame.get("data")
    if not isinstance(data, bytes):
        raise ValueError("state chunk without data")
    return len(data)


def tensor_chunks(tensors: dict[str, torch.Tensor], half: bool = False):
    """``{"ok", "pieces", "last"}`` frames of about ``WEIGHT_CHUNK_BYTES / 2`` carrying ``tensors`` (bf16 if
    ``half``). Pieces: ``[name, dtype, shape, bytes, offset]``; a tensor larger than a frame (an embedding) is
    split at increasing offsets, which :func:`weights_from_chunks` joins again."""
    piece = WEIGHT_CHUNK_BYTES // 2
    entries: list[tuple[str, list]] = []
    for name, t in tensors.items():
        t = t.to(torch.bfloat16) if half and t.is_floating_point() else t
        data = tensor_to_bytes(t)
        dtype, shape = str(t.dtype).removeprefix("torch."), list(t.shape)
        for offset in range(0, max(1, len(data)), piece):
            entries.append((name, [dtype, shape, data[offset : offset + piece], offset]))
    chunk: list[list] = []
    size = 0
    for i, (name, spec) in enumerate(entries):
        chunk.append([name, *spec])
        size += len(spec[2])
        last = i == len(entries) - 1
        if size >= piece or last:
            yield {"ok": True, "pieces": chunk, "last": last}
            chunk, size = [], 0


def pieces_bytes(frame: dict) -> int:
    """Tensor bytes in a weights / DP log frame (``pieces``: ``[name, dtype, shape, data, offset]`` lists)."""
    pieces = frame.get("pieces")
    if not isinstance(pieces, list):
        return 0
    return sum(len(p[3]) for p in pieces if isinstance(p, list) and len(p) == 5 and isinstance(p[3], bytes))


def weights_from_chunks(chunks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Rebuild a state dict from :meth:`StageHost.weights_stream` chunks (pieces in order; all checked)."""
    parts: dict[str, tuple[str, list, bytearray]] = {}
    for chunk in chunks:
        pieces = chunk.get("pieces")
        if not isinstance(pieces, list):
            raise WireError("weight chunk without pieces")
        for entry in pieces:
            if not isinstance(entry, list) or len(entry) != 5:
                raise WireError("weight piece: malformed entry")
            name, dtype, shape, data, offset = entry
            if not isinstance(name, str) or not isinstance(data, bytes) or not isinstance(offset, int):
                raise WireError(f"weight piece {name!r}: malformed entry")
            if name not in parts:
                parts[name] = (dtype, shape, bytearray())
            held = parts[name]
            if held[0] != dtype or held[1] != shape or offset != len(held[2]):
                raise WireError(f"weight {name!r}: piece out of order or inconsistent")
            held[2].extend(data)
    out = {}
    for name, (dtype, shape, data) in parts.items():
        if isinstance(shape, list) and len(shape) == 0:  # scalars
            out[name] = tensor_from_bytes(bytes(data), dtype, [1]).reshape(())
        else:
            out[name] = tensor_from_bytes(bytes(data), dtype, shape)
    return out


__all__ = ["StageHost", "tensor_chunks", "weights_from_chunks"]
