"""The in-process mesh: X fast replicas of a Y-stage pipeline (plus an anchor replica) in one process.

It is the reference implementation of the method: the swarm (``meshnode.node``) wraps the same
:class:`~meshnode.stage.StageWorker` objects with RPCs and must reproduce these losses. With X = 1,
masking off and no anchor it is the dense reference training of ``meshnode train``.

One optimizer step of the mesh:

1. every replica r draws ``train.microbatches`` batches from its own data shard (shard r of X) and
   pushes each through its stages (masked boundaries after ``mask.warmup_steps``), then backward;
2. every stage worker clips and steps (spectral correction when priors are present);
3. DP: every ``dp.inner_steps`` (per fragment, staggered) the replicas of each stage all-reduce their
   PowerSGD-compressed pseudo-gradients and take a DiLoCo outer step (``meshnode.mesh.dp``);
4. anchor: every ``anchor.period`` steps the anchor snapshots replica 0's weights, and
   ``anchor.period`` steps later (the delay the swarm would see) its prior reaches every fast
   optimizer (``meshnode.mesh.anchor``).

Checkpoints hold every worker's weights (safetensors), optimizer and DP/anchor state (torch.save),
and the step, which is also the data position; a resumed run continues with bit-identical losses.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..compression import ByteCounter
from ..config import RunConfig, check_model_width
from ..data import BatchSource, heldout_batches, make_tokenizer, prepare_corpus
from ..errors import brief
from ..model import StageModule, average_state_dicts, cut_model, load_model
from ..optim import lr_at
from ..stage import MicrobatchId, ReferenceModel, StageWorker, causal_lm_loss

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1


@dataclass
class TrainResult:
    steps: int
    tokens: int
    wall_s: float
    heldout_loss: float
    losses: list[float] = field(default_factory=list)
    bytes: dict[str, int] = field(default_factory=dict)

    def bytes_per_token(self) -> dict[str, float]:
        return {k: v / max(1, self.tokens) for k, v in self.bytes.items()}


class CheckpointError(ValueError):
    """A checkpoint this run cannot resume from: missing, damaged, or of another run's shape."""


def checkpoint_to_load(directory: Path) -> Path:
    """``directory`` if it holds a checkpoint; else ``directory.old`` when a save was cut off between moving the old
    checkpoint aside and moving the new one in (the new one, incomplete or not, is discarded)."""
    if (directory / "trainer.json").is_file():
        return directory
    old = directory.with_name(directory.name + ".old")
    if not directory.exists() and (old / "trainer.json").is_file():
        logger.warning("no checkpoint in %s, but the one before it in %s (a save was interrupted): resuming from it",
                       directory, old)
        return old
    raise CheckpointError(f"no checkpoint in {directory} (no trainer.json)")


def read_checkpoint_meta(directory: Path) -> dict:
    """``trainer.json`` of a checkpoint directory (CheckpointError if it is damaged)."""
    try:
        meta = json.loads((directory / "trainer.json").read_text())
        if not isinstance(meta, dict):
            raise TypeError(f"a {type(meta).__name__}, not an object")
        return meta
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {directory}: trainer.json is damaged ({brief(exc)})") from None


def read_stage_weights(directory: Path, replica: int, stage: StageModule) -> dict[str, torch.Tensor]:
    """One stage's weights from a checkpoint directory, checked against ``stage``'s names and shapes
    (CheckpointError if the file is damaged or holds another model's or cut's weights)."""
    path = directory / f"replica{replica}-stage{stage.index}.safetensors"
    try:
        loaded = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 (safetensors' own error type, or OSError)
        raise CheckpointError(f"checkpoint {directory}: {path.name} is damaged ({brief(exc)})") from None
    own = stage.state_dict()
    if loaded.keys() != own.keys() or any(loaded[k].shape != own[k].shape for k in own):
        raise CheckpointError(f"checkpoint {directory}: {path.name} holds other weights than this run's stage "
                              f"{stage.index} (another model or cut)")
    return loaded


class MeshTrainer:
    """Build the model, cut it, replicate it X times, and train it as the run config says."""

    def __init__(self, cfg: RunConfig, cache_dir: Path, progress: Callable[[dict], None] | None = None):
        self.cfg = cfg
        self.cache_dir = cache_dir
        self.progress = progress
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        model, hf_tok = load_model(cfg.model, cache_dir)
        check_model_width(cfg, int(model.config.hidden_size))
        self.hf_config = copy.deepcopy(model.config)
        self.hf_tokenizer = hf_tok
        self.tokenizer = make_tokenizer(cfg.model, hf_tok)
        if self.tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(
                f"tokenizer vocab {self.tokenizer.vocab_size} exceeds the model's {model.config.vocab_size}"
            )
        self.corpus = prepare_corpus(cfg.data, self.tokenizer, cache_dir)
        self.eval_set = heldout_batches(self.corpus.heldout, cfg.train.batch_size, cfg.train.eval_batches)
        stages = cut_model(model, cfg.model.stages, cfg.model.boundaries)
        del model
        self.device = torch.device(cfg.train.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"train.device = {cfg.train.device!r}, but torch sees no CUDA device")
        for m in stages.values():
            m.to(self.device)
        self.num_stages = cfg.model.stages
        self.replicas = cfg.dp.replicas if cfg.dp.enabled or cfg.dp.replicas > 1 else 1
        self.counter = ByteCounter()
        # replica 0 owns the cut modules, the others deep copies (identical start weights)
        self.workers: list[list[StageWorker]] = []
        for r in range(self.replicas):
            mods = stages if r == 0 else {s: copy.deepcopy(m) for s, m in stages.items()}
            self.workers.append(
                [StageWorker(mods[s], cfg, replica=r, counter=self.counter) for s in range(self.num_stages)]
            )
        # ``mask.reference``: one frozen copy of the pretrained stages, shared by every worker (both ends of a
        # boundary compute the same reference; in one process it is computed once). With
        # ``mask.reference_refresh_rank`` each replica chain has its own, which follows that chain's weights.
        self.reference: ReferenceModel | None = None
        self.references: list[ReferenceModel] = []
        if cfg.mask.reference != "none":
            own = 1 if not cfg.mask.reference_refresh_rank else self.replicas
            self.references = [ReferenceModel([stages[s] for s in range(self.num_stages)],
                                              autocast=self.workers[0][0].autocast) for _ in range(own)]
            self.reference = self.references[0]
            for r, chain in enumerate(self.workers):
                for w in chain:
                    w.reference = self.references[r % own]
        self.sources = [
            BatchSource(
                self.corpus.train, cfg.train.batch_size, shard=r, num_shards=self.replicas, seed=cfg.train.seed
            )
            for r in range(self.replicas)
        ]
        self.step = 0
        self.tokens = 0
        self.losses: list[float] = []
        # DP and anchor hooks: objects with after_step(trainer, step), state_dict(), load_state_dict()
        from .anchor import maybe_anchor
        from .dp import maybe_dp
        from .refresh import maybe_reference

        self.dp = maybe_dp(self)
        self.anchor = maybe_anchor(self)
        # ``mask.reference_refresh``: the reference follows the weights (after DP's rounds, before the anchor's cycle)
        self.refresh = maybe_reference(self)
        self.extensions = [e for e in (self.dp, self.refresh, self.anchor) if e is not None]

    # ------------------------------------------------------------------------------------------

    def stage_modules(self, replica: int = 0) -> list[StageModule]:
        return [w.module for w in self.workers[replica]]

    def run_microbatch(self, workers: list[StageWorker], mb: MicrobatchId, ids: torch.Tensor) -> float:
        """Forward and backward of one microbatch through a chain of workers; returns its loss."""
        x = ids
        for w in workers[:-1]:
            x = w.forward(mb, x, labels=ids)
        loss = workers[-1].forward(mb, x, labels=ids)
        grad = None
        for w in reversed(workers):
            grad = w.backward(mb, grad)
        return loss

    def train_step(self) -> dict:
        cfg = self.cfg
        step = self.step
        lr = lr_at(step, cfg.train.lr, cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio)
        losses = []
        tokens = 0
        skipped = 0  # stage steps not taken: a non-finite gradient (StageWorker.step kept the weights)
        for r, workers in enumerate(self.workers):
            for m in range(cfg.train.microbatches):
                ids = self.sources[r].batch(step * cfg.train.microbatches + m).to(self.device)
                losses.append(self.run_microbatch(workers, MicrobatchId(step, m), ids))
                tokens += ids.numel()
            for w in workers:
                skipped += bool(w.step(step, lr)["skipped"])
        for ext in self.extensions:
            ext.after_step(self, step)
        self.step += 1
        self.tokens += tokens
        loss = sum(losses) / len(losses)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}")
        self.losses.append(loss)
        M = cfg.train.microbatches
        by_replica = [sum(losses[r * M:(r + 1) * M]) / M for r in range(len(self.workers))]
        rec = {"step": step, "tokens": self.tokens, "loss": loss, "lr": lr, "replica_loss": by_replica}
        if skipped:
            rec["skipped_stages"] = skipped
        return rec

    @torch.no_grad()
    def heldout_loss(self, replica: int = 0, batches: list[torch.Tensor] | None = None) -> float:
        """Mean held-out loss of one replica, unmasked (evaluation never masks)."""
        workers = self.workers[replica]
        total = 0.0
        batches = batches if batches is not None else self.eval_set
        for ids in batches:
            x = ids = ids.to(self.device)
            for w in workers:
                x = w.eval_forward(x)
            total += float(causal_lm_loss(x, ids))
        return total / len(batches)

    @torch.no_grad()
    def heldout_loss_of_mean(self, batches: list[torch.Tensor] | None = None) -> float:
        """Held-out loss of the replicas' exact average (every parameter's mean over the X replicas): the model one
        closing uncompressed all-reduce of the live weights would leave every peer of a stage with. With
        ``dp.keep_residual`` the replicas differ by what their rounds did not send, and this is what they hold
        together. Replica 0 is borrowed for it and left exactly as it was."""
        if len(self.workers) == 1:
            return self.heldout_loss(0, batches)
        kept = []
        for s, w in enumerate(self.workers[0]):
            params = dict(w.module.named_parameters())
            kept.append({n: p.detach().clone() for n, p in params.items()})
            mean = average_state_dicts([dict(row[s].module.named_parameters()) for row in self.workers])
            for n, p in params.items():
                p.copy_(mean[n])
        try:
            return self.heldout_loss(0, batches)
        finally:
            for w, saved in zip(self.workers[0], kept):
                for n, p in w.module.named_parameters():
                    p.copy_(saved[n])

    # ------------------------------------------------------------------------------------------

    def train(
        self,
        until: int | None = None,
        metrics: Callable[[dict], None] | None = None,
        checkpoint_dir: Path | None = None,
    ) -> TrainResult:
        """Train from the current step up to ``until`` (default ``train.steps``), emitting metric records."""
        cfg = self.cfg
        until = cfg.train.steps if until is None else min(until, cfg.train.steps)
        emit = metrics or (lambda rec: None)
        start_wall = time.perf_counter()
        start_tokens = self.tokens
        if self.step == 0 and cfg.train.eval_every:
            emit({"step": 0, "heldout_loss": self.heldout_loss()})
        while self.step < until:
            rec = self.train_step()
            rec["wall_s"] = round(time.perf_counter() - start_wall, 4)
            rec["bytes"] = self.counter.snapshot()
            emit(rec)
            if self.progress:
                self.progress(rec)
            done = self.step
            if cfg.train.eval_every and done % cfg.train.eval_every == 0 and done < cfg.train.steps:
                emit({"step": done, "heldout_loss": self.heldout_loss()})
            if checkpoint_dir and cfg.train.checkpoint_every and done % cfg.train.checkpoint_every == 0:
                self.save_checkpoint(checkpoint_dir)
        wall = time.perf_counter() - start_wall
        held = self.heldout_loss()
        if checkpoint_dir:
            self.save_checkpoint(checkpoint_dir)
        trained = self.tokens - start_tokens
        result = TrainResult(
            steps=self.step, tokens=self.tokens, wall_s=wall, heldout_loss=held, losses=list(self.losses),
            bytes=self.counter.snapshot(),
        )
        final = {
            "final": True, "step": self.step, "steps": self.step, "heldout_loss": held,
            "tokens_per_s": trained / wall if wall > 0 else 0.0, "tokens": self.tokens,
            "bytes_per_token": result.bytes_per_token(),
        }
        if len(self.workers) > 1:  # heldout_loss is replica 0's; the replicas' exact mean is what they hold together
            final["heldout_loss_mean"] = self.heldout_loss_of_mean()
        emit(final)
        return result

    # ------------------------------------------------------------------------------------------
    # checkpoints

    def save_checkpoint(self, directory: Path) -> Path:
        """Write weights, optimizer state, reference coding's fits, DP/anchor state and the step; atomically
        replaces ``directory``."""
        directory = Path(directory)
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        weights, state = self._resumable_state()
        for key, stage_weights in weights.items():
            r, s = key.split(".")
            save_file(stage_weights, str(tmp / f"replica{r}-stage{s}.safetensors"))
        torch.save(state, tmp / "state.pt")
        meta = {
            "format": CHECKPOINT_FORMAT, "step": self.step, "tokens": self.tokens, "losses": self.losses,
            "bytes": self.counter.snapshot(), "run_id": self.cfg.run_id, "config": self.cfg.to_dict(),
            "replicas": self.replicas, "stages": self.num_stages,
        }
        (tmp / "trainer.json").write_text(json.dumps(meta))
        self.hf_config.to_json_file(str(tmp / "hf_config.json"))
        if self.hf_tokenizer is not None:
            self.hf_tokenizer.save_pretrained(str(tmp / "tokenizer"))
        old = directory.with_name(directory.name + ".old")
        if directory.exists():
            shutil.rmtree(old, ignore_errors=True)
            directory.rename(old)
        tmp.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
        return directory

    def _resumable_state(self, copied: bool = False) -> tuple[dict, dict]:
        """What a checkpoint holds of the workers and extensions, in :meth:`_load_resumable_state`'s arguments'
        form: ({"replica.stage": weights}, {"optim", "fits", "extensions"}); the live tensors, or a copy
        (``copied``: to put back after a failed load)."""
        own = copy.deepcopy if copied else (lambda x: x)
        weights, state = {}, {"optim": {}, "fits": {}, "extensions": {}}
        for r, workers in enumerate(self.workers):
            for w in workers:
                key = f"{r}.{w.index}"
                weights[key] = own({k: v.detach().contiguous() for k, v in w.module.state_dict().items()})
                state["optim"][key] = own(w.optimizer_state())
                state["fits"][key] = own(w.fit_state())
        for e in self.extensions:
            state["extensions"][type(e).__name__] = own(e.state_dict())
        return weights, state

    def _load_resumable_state(self, weights: dict, state: dict) -> None:
        for r, workers in enumerate(self.workers):
            for w in workers:
                w.module.load_state_dict(weights[f"{r}.{w.index}"])
                w.load_optimizer_state(state["optim"][f"{r}.{w.index}"])
                fits = state.get("fits", {}).get(f"{r}.{w.index}")  # reference coding's maps and codes
                if fits is not None:
                    w.load_fit_state(fits)
        for e in self.extensions:
            e.load_state_dict(state["extensions"][type(e).__name__])

    def load_checkpoint(self, directory: Path) -> None:
        """Resume from :meth:`save_checkpoint`'s ``directory``. Every file is read and checked against this run (its
        replicas, stages, each stage's weight names and shapes, an optimizer state per worker and a state per
        extension) before anything changes: a damaged or foreign checkpoint is a :class:`CheckpointError` naming the
        file, and leaves this trainer as it was. A state that passes these checks but was saved under other optimizer,
        coding or extension settings fails while loading: everything loaded so far is put back as it was, and that
        too is a :class:`CheckpointError`. A
        save cut off between its two renames left only ``directory.old``, the previous checkpoint: that is loaded,
        with a warning."""
        directory = checkpoint_to_load(Path(directory))
        meta = read_checkpoint_meta(directory)
        try:
            step, tokens = int(meta["step"]), int(meta["tokens"])
            losses = [float(x) for x in meta["losses"]]
            counter = ByteCounter.from_snapshot(meta["bytes"])
            shape = (meta.get("replicas"), meta.get("stages"))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"checkpoint {directory}: trainer.json is damaged ({brief(exc)})") from None
        if shape != (self.replicas, self.num_stages):
            raise CheckpointError(f"checkpoint has {shape[0]} replicas x {shape[1]} stages, "
                                  f"this run {self.replicas} x {self.num_stages}")
        try:  # its own checkpoint's pickled state (options, numbers); a truncated file raises whatever unpickling hit
            state = torch.load(directory / "state.pt", weights_only=False, map_location=self.device)
        except Exception as exc:  # noqa: BLE001 (torch.load's errors have no common base)
            raise CheckpointError(f"checkpoint {directory}: state.pt is damaged ({brief(exc)})") from None
        if not isinstance(state, dict) or not isinstance(state.get("optim"), dict):
            raise CheckpointError(f"checkpoint {directory}: state.pt holds no optimizer states")
        weights = {}
        for r, workers in enumerate(self.workers):
            for w in workers:
                key = f"{r}.{w.index}"
                weights[key] = read_stage_weights(directory, r, w.module)
                if key not in state["optim"]:
                    raise CheckpointError(f"checkpoint {directory}: state.pt has no optimizer state of {key}")
        missing = [type(e).__name__ for e in self.extensions if type(e).__name__ not in state.get("extensions", {})]
        if missing:
            raise CheckpointError(f"checkpoint {directory}: state.pt has no state of {', '.join(missing)} "
                                  "(saved by a run without it)")
        before = self._resumable_state(copied=True)
        try:
            self._load_resumable_state(weights, state)
        except Exception as exc:  # noqa: BLE001 (a state of other settings fails wherever its loader notices)
            self._load_resumable_state(*before)
            raise CheckpointError(f"checkpoint {directory} was saved under other settings than this run's "
                                  f"({brief(exc)}); nothing was loaded") from exc
        self.step, self.tokens, self.losses, self.counter = step, tokens, losses, counter
        for workers in self.workers:
            for w in workers:
                w.counter = self.counter

