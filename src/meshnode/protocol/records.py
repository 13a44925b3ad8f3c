"""DHT record schemas: the peer record and the anchor prior, validated and signed.

Every record lives under a run-scoped key (see :mod:`.keys`) with a subkey that embeds its owner's
RSA public key, so hivemind's :class:`RSASignatureValidator` lets only the owner write it; the
pydantic schemas below are enforced by hivemind's :class:`SchemaValidator` on every store and every
read. Records tolerate unknown fields (newer peers may add some) and expire; peers re-announce.

The peer record says what ``meshnode status`` shows: role, stage, state, throughput, steps, recent
loss, bytes sent per axis, the prior it holds, the optimizer steps it skipped for a non-finite
gradient, the digest of the reference model it codes against. The prior record carries one targeted
matrix's truncated factors (fp16 ``U (m, r)``, ``s (r,)``, ``Vh (r, n)``) of one anchor cycle; a
header record per anchor names the cycle whose matrices are complete.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import pydantic.v1 as pydantic
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from pydantic.v1 import StrictBool, StrictBytes, StrictFloat, StrictInt, StrictStr, confloat, conint, constr

from .keys import owner_of

ROLES = ("fast", "driver", "anchor")
STATES = ("joining", "online", "offline")
SOFTWARE_VERSION = "meshnode-swarm/1"


# ---------------------------------------------------------------------------------------------
# schemas (pydantic v1, as hivemind's SchemaValidator expects; strict number types)


class PeerRecordSchema(pydantic.BaseModel):
    peer_id: constr(strict=True, min_length=1, max_length=128)
    role: constr(strict=True, regex=r"^(fast|driver|anchor)$")
    stage: conint(strict=True, ge=-1, le=4096)
    num_stages: conint(strict=True, ge=1, le=4096) | None = None
    state: constr(strict=True, regex=r"^(joining|online|offline)$")
    layers: list[StrictInt] | None = None
    throughput: StrictFloat | None = None
    capacity: confloat(strict=True, ge=0.0, le=1e12) | None = None  # routing weighs it: no NaN, inf or negatives
    step: conint(strict=True, ge=0) | None = None
    driver_step: conint(strict=True, ge=0) | None = None
    tokens: conint(strict=True, ge=0) | None = None
    loss: StrictFloat | None = None
    bytes: dict[StrictStr, conint(strict=True, ge=0)] | None = None
    prior_step: StrictInt | None = None
    dp_syncs: conint(strict=True, ge=0) | None = None
    skipped_steps: conint(strict=True, ge=0) | None = None  # optimizer steps skipped for a non-finite gradient
    reference: constr(strict=True, min_length=1, max_length=64) | None = None  # digest of its frozen reference
    # mask.reference_check: the largest relative difference of a caller's sampled reference from its own, and the
    # microbatches it refused for one above mask.reference_tolerance
    ref_mismatch: confloat(strict=True, ge=0.0, le=1e12) | None = None
    ref_refused: conint(strict=True, ge=0) | None = None
    shard: conint(strict=True, ge=0, le=65535) | None = None  # a driver's data shard (of dp.replicas)
    movable: StrictBool | None = None  # it moves into a stage left without peers (rebalancing)
    busy: StrictBool | None = None  # a microbatch, an optimizer step or a DP sync in progress when announced
    version: StrictStr | None = None
    updated: StrictFloat | None = None

    class Config:
        extra = pydantic.Extra.allow  # tolerate fields of newer peers (kept, so the validator sees no conversion)


class PriorRecordSchema(pydantic.BaseModel):
    kind: constr(strict=True, regex=r"^(header|matrix)$")
    anchor_step: conint(strict=True, ge=0)
    name: constr(strict=True, max_length=256) | None = None
    names: list[StrictStr] | None = None
    rank: conint(strict=True, ge=1, le=4096) | None = None
    shape: list[StrictInt] | None = None
    u: StrictBytes | None = None
    s: StrictBytes | None = None
    vh: StrictBytes | None = None
    digest: StrictStr | None = None
    final: StrictBool | None = None
    source: constr(strict=True, max_length=128) | None = None  # header: the peer id serving the factors (rpc)

    class Config:
        extra = pydantic.Extra.allow


def make_schema_validator(run: str, num_stages: int) -> SchemaValidator:
    """A SchemaValidator for every key of ``run``: ``{run}_peers``, ``{run}_prior_{stage}`` and
    ``{run}_priordata_{stage}``."""
    fields: dict[str, Any] = {"peers": (dict[BytesWithPublicKey, PeerRecordSchema | None], None)}
    for s in range(num_stages):
        fields[f"prior_{s}"] = (dict[BytesWithPublicKey, PriorRecordSchema | None], None)
        fields[f"priordata_{s}"] = (dict[BytesWithPublicKey, PriorRecordSchema | None], None)
    model = pydantic.create_model(f"SwarmSchema_{abs(hash(run))}", **fields)
    return SchemaValidator(model, allow_extra_keys=True, prefix=run)


# ---------------------------------------------------------------------------------------------
# the python side


@dataclass
class PeerRecord:
    """One peer as announced in ``{run}_peers`` (``owner`` = its public key, from the subkey)."""

    peer_id: str
    role: str
    stage: int
    state: str
    num_stages: int = 0
    layers: list[int] = field(default_factory=list)
    throughput: float = 0.0  # tokens served per second (its share of the load)
    capacity: float = 0.0  # tokens per second of its own compute (what routing weighs; 0 = not measured yet)
    step: int = 0
    driver_step: int | None = None
    tokens: int = 0
    loss: float | None = None
    bytes: dict[str, int] = field(default_factory=dict)
    prior_step: int | None = None
    dp_syncs: int = 0
    skipped_steps: int = 0  # optimizer steps this stage replica skipped: its gradient was not finite
    reference: str | None = None  # reference coding: the digest of the frozen pretrained model (None: not coded)
    ref_mismatch: float = 0.0  # the largest relative difference of a caller's sampled reference from its own
    ref_refused: int = 0  # microbatches refused for a reference that differs by more than mask.reference_tolerance
    shard: int | None = None
    movable: bool = False
    busy: bool = False
    version: str = SOFTWARE_VERSION
    updated: float = 0.0
    owner: str = ""
    expiration: float = 0.0

    def to_value(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("owner")
        d.pop("expiration")
        d["throughput"] = float(d["throughput"])
        d["capacity"] = float(d["capacity"])
        d["ref_mismatch"] = float(d["ref_mismatch"])
        d["updated"] = float(d["updated"] or time.time())
        if d["loss"] is not None:
            d["loss"] = float(d["loss"])
        if not d.get("num_stages"):
            d["num_stages"] = None
        # every schema field, None included: hivemind's SchemaValidator refuses a value that parsing would change
        return {k: d.get(k) for k in PeerRecordSchema.__fields__}

    @classmethod
    def from_value(cls, value: Any, owner: str = "", expiration: float = 0.0) -> PeerRecord | None:
        """Parse a stored value; None when it does not fit the schema (unknown fields are dropped)."""
        if not isinstance(value, dict):
            return None
        try:
            parsed = PeerRecordSchema.parse_obj(value).dict()
        except pydantic.ValidationError:
            return None
        known = {k: v for k, v in parsed.items() if v is not None and k in _PEER_FIELDS}
        return cls(**known, owner=owner, expiration=expiration)

    @property
    def online(self) -> bool:
        return self.state == "online"


_PEER_FIELDS = set(PeerRecordSchema.__fields__)


def prior_value(**fields: Any) -> dict[str, Any]:
    """A prior record value with every schema field present (None where unused)."""
    return {k: fields.get(k) for k in PriorRecordSchema.__fields__}


def parse_peers(found: Any) -> list[PeerRecord]:
    """Peer records from a ``dht.get(peers_key(run), latest=True)`` result (None when nothing is stored)."""
    if found is None or not isinstance(found.value, dict):
        return []
    out = []
    for subkey, item in found.value.items():
        rec = PeerRecord.from_value(item.value, owner=owner_of(subkey) or "", expiration=item.expiration_time)
        if rec is not None:
            out.append(rec)
    return sorted(out, key=lambda r: (r.stage, r.peer_id))


def factors_digest(u: bytes, s: bytes, vh: bytes) -> str:
    return hashlib.sha256(u + s + vh).hexdigest()[:16]


def cycle_digest(digests: dict[str, str]) -> str:
    """One digest over a cycle's matrix digests (by name): the header's binding to its factors."""
    return hashlib.sha256("".join(f"{k}={digests[k]};" for k in sorted(digests)).encode()).hexdigest()[:16]


__all__ = [
    "PeerRecord", "PeerRecordSchema", "PriorRecordSchema", "ROLES", "prior_value", "SOFTWARE_VERSION", "STATES",
    "cycle_digest", "factors_digest", "make_schema_validator", "parse_peers",
]
