"""Wire messages and DHT records: every malformed input is a WireError before any tensor is built."""

from __future__ import annotations

import asyncio
import math

import msgpack
import pytest
import torch

from meshnode.compression import BoundaryContext, DenseCodec, MaskCodec, MaskKey, RotQuantCodec
from meshnode.protocol import keys
from meshnode.protocol.limits import Limits
from meshnode.protocol.messages import (
    WireError,
    forward_request,
    pack,
    parse_backward,
    parse_forward,
    payload_from_wire,
    payload_to_wire,
    read_frame,
    tensor_from_bytes,
    unpack,
)
from meshnode.protocol.records import PeerRecord, PriorRecordSchema, make_schema_validator, prior_value

LIMITS = Limits(max_message_bytes=1 << 20, max_batch=4, max_seq=16, hidden=32, vocab=260)


def _payload(codec=None, b=2, t=8, h=32, value=None):
    codec = codec or DenseCodec("bfloat16")
    x = torch.randn(b, t, h) if value is None else torch.full((b, t, h), value)
    ctx = BoundaryContext(key=MaskKey(run_seed=0, step=3, microbatch=1, boundary=0))
    return codec.encode(x, ctx)


def _request(payload=None, **over):
    payload = payload or _payload()
    b, t = payload.shape[:2]
    req = forward_request(run="r", driver="d", step=3, mb=1, attempt=7, boundary=0, mask_version=0, payload=payload,
                          labels=torch.randint(0, 260, (b, t)), vocab=260)
    req.update(over)
    return req


def _parse(req):
    return parse_forward(unpack(pack(req), LIMITS.max_message_bytes), LIMITS, run="r", stage=1, mask_version=0)


def test_round_trip_dense_mask_rotq():
    codecs = (DenseCodec("bfloat16"), MaskCodec(0.9, wire_dtype="float16"), MaskCodec(0.9, fill="mean"),
              RotQuantCodec(2), RotQuantCodec(2, weight="norm_std", grad_bits=4))  # the last: 4 tensors
    for codec in codecs:
        p = _payload(codec)
        req = _parse(_request(p))
        assert req.payload.shape == p.shape and req.payload.codec == p.codec
        for k, t in p.tensors.items():
            assert torch.equal(req.payload.tensors[k], t)
        assert req.labels.dtype == torch.int64 and req.replay_id == ("d", 3, 1, 7)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda r: r.update(run="other"), "run"),
        (lambda r: r.update(boundary=1), "boundary"),
        (lambda r: r.update(step=-1), "step"),
        (lambda r: r.update(step="3"), "step"),
        (lambda r: r.update(v=99), "version"),
        (lambda r: r["payload"].update(codec="pickle"), "codec"),
        (lambda r: r["payload"].update(kind="grad"), "activation"),
        (lambda r: r["payload"].update(dtype="float64"), "dtype"),
        (lambda r: r["payload"].update(shape=[2, 8, 33]), "limits"),
        (lambda r: r["payload"].update(shape=[64, 8, 32]), "limits"),
        (lambda r: r["payload"].update(shape=[2, 8]), "shape"),
        (lambda r: r["payload"]["tensors"].update(values=["complex64", [2, 8, 32]]), "not allowed"),
        (lambda r: r["payload"]["tensors"].update(values=["bfloat16", [2, 8, 32, 1]]), "dims"),
        (lambda r: r["payload"]["tensors"].update(values=["bfloat16", [2, 8, 0]]), "positive"),
        (lambda r: r["payload"]["data"].update(values=b"\x00" * 10), "bytes"),
        (lambda r: r["labels"].update(shape=[2, 9]), "bytes"),
        (lambda r: r["labels"].update(dtype="float32"), "labels"),
        (lambda r: r.update(held_codes=[[1, 2, 3]]), "held_codes"),
        (lambda r: r.update(held_codes=[[1, True]]), "held_codes"),
        (lambda r: r.update(held_codes="all"), "held_codes"),
        (lambda r: r.update(held_codes=[[1, 2]] * 65), "held_codes"),
        (lambda r: r.update(reference=123), "reference"),
        (lambda r: r.update(reference=""), "reference"),
        (lambda r: r.update(reference="f" * 65), "reference"),
        (lambda r: (r["payload"]["tensors"].update(ref_code_scale=["float32", [33]]),
                    r["payload"]["data"].update(ref_code_scale=b"\x00" * 132)), "transform"),
        (lambda r: (r["payload"]["tensors"].update(ref_map_u_step=["float32", [4, 4]]),
                    r["payload"]["data"].update(ref_map_u_step=b"\x00" * 64)), "transform"),
        (lambda r: (r["payload"]["tensors"].update(ref_check=["float32", [65]]),
                    r["payload"]["data"].update(ref_check=b"\x00" * 260)), "reference check"),
        (lambda r: (r["payload"]["tensors"].update(ref_check=["float32", [2, 4]]),
                    r["payload"]["data"].update(ref_check=b"\x00" * 32)), "reference check"),
    ],
)
def test_malformed_forward_is_refused(mutate, needle):
    req = _request()
    mutate(req)
    with pytest.raises(WireError, match=needle):
        _parse(req)


def test_a_reference_check_travels_with_a_forward():
    p = _payload()
    p.tensors["ref_check"] = torch.linspace(-1.0, 1.0, 64)
    assert torch.equal(_parse(_request(p)).payload.tensors["ref_check"], p.tensors["ref_check"])


def test_the_reference_digest_travels_with_a_forward():
    p = _payload()
    b, t = p.shape[:2]
    req = forward_request(run="r", driver="d", step=3, mb=1, attempt=7, boundary=0, mask_version=0, payload=p,
                          labels=torch.randint(0, 260, (b, t)), vocab=260, reference="4d4989d44740684e")
    assert _parse(req).reference == "4d4989d44740684e"
    assert _parse(_request()).reference is None  # a caller without reference coding sends none


def test_non_finite_values_are_refused():
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(WireError, match="non-finite"):
            _parse(_request(_payload(value=bad)))


def test_label_range_and_backward_checks():
    req = _request()
    ids = torch.full((2, 8), 300, dtype=torch.int32)
    req["labels"] = {"dtype": "int32", "shape": [2, 8], "data": ids.numpy().tobytes()}
    with pytest.raises(WireError, match="label ids"):
        _parse(req)
    g = DenseCodec("bfloat16").encode_grad(torch.randn(2, 8, 32))
    body = {"v": 1, "type": "backward", "run": "r", "driver": "d", "step": 1, "mb": 0, "attempt": 0, "boundary": 1,
            "payload": payload_to_wire(g)}
    assert parse_backward(body, LIMITS, run="r", stage=1).payload.kind == "grad"
    with pytest.raises(WireError, match="grad"):
        payload_from_wire(payload_to_wire(_payload()), LIMITS, "grad")


def test_unpack_garbage_and_size():
    for junk in (b"", b"\xc1", bytes(range(256)), msgpack.packb([1, 2, 3]), msgpack.packb("x")):
        with pytest.raises(WireError):
            unpack(junk, 1 << 20)
    with pytest.raises(WireError, match="exceeds"):
        unpack(b"\x00" * 100, 10)


def test_read_frame_checks_length_before_reading():
    async def go(data: bytes, limit: int):
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader, limit)

    with pytest.raises(WireError, match="exceeds"):
        asyncio.run(go((10**9).to_bytes(8, "big"), 1000))
    with pytest.raises(WireError, match="truncated"):
        asyncio.run(go((100).to_bytes(8, "big") + b"abc", 1000))
    assert asyncio.run(go((3).to_bytes(8, "big") + b"abc", 1000)) == b"abc"


def test_tensor_from_bytes_exact_length():
    t = torch.arange(6, dtype=torch.float32)
    assert torch.equal(tensor_from_bytes(t.numpy().tobytes(), "float32", [2, 3]), t.reshape(2, 3))
    with pytest.raises(WireError):
        tensor_from_bytes(t.numpy().tobytes()[:-1], "float32", [2, 3])


def test_peer_record_round_trip_and_unknown_fields():
    r = PeerRecord(peer_id="p", role="fast", stage=1, num_stages=3, state="online", loss=2.5, bytes={"pp_fwd": 10})
    v = r.to_value()
    back = PeerRecord.from_value({**v, "future_field": 1})
    assert back is not None and back.stage == 1 and back.bytes == {"pp_fwd": 10}
    assert PeerRecord.from_value({**v, "stage": "1"}) is None
    assert PeerRecord.from_value({**v, "role": "boss"}) is None
    assert PeerRecord.from_value({**v, "step": 1.5}) is None
    assert math.isclose(back.loss, 2.5)


def test_schema_validator_and_keys(tmp_path):
    validator = make_schema_validator("run-abc", 2)
    assert validator is not None
    key_file = tmp_path / "id.key"
    k1 = keys.load_or_create_identity(key_file)
    k2 = keys.load_or_create_identity(key_file)
    assert keys.public_key_string(k1) == keys.public_key_string(k2)
    tag = keys.owner_tag(k1)
    assert keys.owner_of(tag + b"/layers.0.q_proj") == keys.public_key_string(k1)
    assert keys.owner_of(b"no key") is None
    (tmp_path / "bad.key").write_bytes(b"not a key")
    with pytest.raises(ValueError, match="RSA"):
        keys.load_or_create_identity(tmp_path / "bad.key")
    value = prior_value(kind="header", anchor_step=3, names=["a"])
    assert PriorRecordSchema.parse_obj(value).anchor_step == 3
