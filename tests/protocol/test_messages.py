"""Framing and argument validation: every bad frame becomes a ProtocolError naming what was wrong."""

from __future__ import annotations

import contextlib
import re

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.protocol.messages import (
    PROTOCOL_VERSION,
    ErrorCode,
    Op,
    ProtocolError,
    decode_reply,
    decode_request,
    encode_error,
    encode_request,
    encode_result,
    pack_ids,
    unpack_ids,
)
from kvferry.server.requests import parse_args


def test_request_round_trip() -> None:
    args = {"tokens": pack_ids([1, 2, 3], "tokens"), "lock": True, "registration": 4}
    request = decode_request(encode_request(Op.LOOKUP, 17, args))
    assert (request.id, request.op, request.args) == (17, Op.LOOKUP, args)
    parsed = parse_args(request.op, request.args, request.id)
    assert parsed.lock is True and unpack_ids(parsed.tokens, "tokens").tolist() == [1, 2, 3]


def test_lookup_from_a_chunk_and_demote_round_trip() -> None:
    tokens = pack_ids(list(range(12)), "tokens")
    lookup = decode_request(encode_request(Op.LOOKUP, 3, {"tokens": tokens, "registration": 1, "first_chunk": 2}))
    assert parse_args(lookup.op, lookup.args, lookup.id).first_chunk == 2
    assert parse_args(Op.LOOKUP, {"tokens": tokens, "registration": 1}, 4).first_chunk == 0  # absent: every chunk
    args = {"tokens": tokens, "first_chunk": 1, "num_chunks": 2, "namespace": {"model": "m", "kv_dtype": "bf16",
                                                                               "layout": "l"}}  # fmt: skip
    demote = decode_request(encode_request(Op.DEMOTE, 5, args))
    assert (demote.op, demote.args) == (Op.DEMOTE, args)
    parsed = parse_args(demote.op, demote.args, demote.id)
    assert (parsed.first_chunk, parsed.num_chunks, parsed.registration) == (1, 2, None)
    assert parsed.namespace.model == "m" and unpack_ids(parsed.tokens, "tokens").tolist() == list(range(12))


def test_reply_round_trip() -> None:
    assert decode_reply(encode_result(3, {"tokens": 256})).result == {"tokens": 256}
    error = decode_reply(encode_error(None, ErrorCode.TOO_LARGE, "big"))
    assert (error.id, error.ok, error.error_code, error.error_message) == (None, False, "TOO_LARGE", "big")


@pytest.mark.parametrize(
    ("payload", "code", "fragment"),
    [
        (b"\xc1", ErrorCode.MALFORMED, "not valid msgpack"),
        (msgpack.packb([1, 2]), ErrorCode.MALFORMED, "must be a msgpack map"),
        (msgpack.packb({"v": 1, "id": -3, "op": "PING"}), ErrorCode.MALFORMED, "'id' must be an int"),
        (msgpack.packb({"v": 1, "id": True, "op": "PING"}), ErrorCode.MALFORMED, "'id' must be an int"),
        (msgpack.packb({"v": 9, "id": 1, "op": "PING"}), ErrorCode.VERSION_MISMATCH, "protocol version 1"),
        (msgpack.packb({"v": 1, "id": 1, "op": "FLY"}), ErrorCode.UNKNOWN_OP, "'FLY' is not one of"),
        (msgpack.packb({"v": 1, "id": 1, "op": "PING", "args": []}), ErrorCode.MALFORMED, "'args' must be a map"),
        (msgpack.packb({"v": 1, "id": 1, "op": "PING", "x": 0}), ErrorCode.MALFORMED, "unknown fields ['x']"),
    ],
)
def test_bad_envelopes(payload: bytes, code: ErrorCode, fragment: str) -> None:
    with pytest.raises(ProtocolError) as err:
        decode_request(payload)
    assert err.value.code == code and fragment in err.value.message


def test_version_error_keeps_the_request_id() -> None:
    with pytest.raises(ProtocolError) as err:
        decode_request(msgpack.packb({"v": PROTOCOL_VERSION + 1, "id": 42, "op": "PING"}))
    assert err.value.request_id == 42


@pytest.mark.parametrize(
    ("op", "args", "fragment"),
    [
        (Op.PING, {"extra": 1}, "'extra': Extra inputs are not permitted"),
        (Op.STORE, {"registration": 1, "tokens": b""}, "'block_ids': Field required"),
        (Op.STORE, {"registration": "1", "tokens": b"", "block_ids": b""}, "'registration': Input should be"),
        (
            Op.RETRIEVE,
            {"registration": 1, "tokens": b"", "block_ids": b"", "skip_prefix_tokens": -1},
            "greater than or equal to 0",
        ),
        (Op.LOOKUP, {"tokens": [1, 2]}, "'tokens': Input should be a valid bytes"),
        (Op.LOOKUP, {"tokens": b"", "first_chunk": -1}, "'first_chunk': Input should be greater than or equal to 0"),
        (Op.LOOKUP, {"tokens": b"", "first_chunk": "2"}, "'first_chunk': Input should be a valid integer"),
        (Op.LOOKUP, {"tokens": b"", "first_chunk": True}, "'first_chunk': Input should be a valid integer"),
        (Op.LOOKUP, {"tokens": b"", "first_chunk": 1.5}, "'first_chunk': Input should be a valid integer"),
        (Op.DEMOTE, {"tokens": b"", "registration": 1}, "'num_chunks': Field required"),
        (Op.DEMOTE, {"tokens": b"", "num_chunks": -2}, "'num_chunks': Input should be greater than or equal to 0"),
        (Op.DEMOTE, {"tokens": b"", "num_chunks": 1, "first_chunk": None}, "'first_chunk': Input should be a valid"),
        (Op.DEMOTE, {"num_chunks": 1, "registration": 1}, "'tokens': Field required"),
        (Op.DEMOTE, {"tokens": b"", "num_chunks": 1, "chunks": [0, 1]}, "'chunks': Extra inputs are not permitted"),
        (Op.REGISTER_KV_CACHE, {"format": 1, "namespace": {"model": "m"}, "storages": [], "kv": {}}, "storages"),
    ],
)
def test_bad_arguments_name_the_field(op: Op, args: dict, fragment: str) -> None:
    with pytest.raises(ProtocolError) as err:
        parse_args(op, args, 1)
    assert err.value.code == ErrorCode.BAD_ARGUMENT and fragment in err.value.message


def test_pack_ids_accepts_lists_arrays_and_tensors() -> None:
    expected = pack_ids([0, 5, 2**32 - 1], "tokens")
    assert pack_ids(np.array([0, 5, 2**32 - 1], dtype=np.uint64), "tokens") == expected
    assert pack_ids(torch.tensor([0, 5, 2**32 - 1]), "tokens") == expected
    assert pack_ids([], "tokens") == b""
    # uint32 arrays (how prompts are kept) as they are: a slice, a strided view, another byte order
    ids = np.arange(40, dtype="<u4") * 7919
    for view in (ids, ids[3:17], ids[::3], ids.astype(">u4")):
        assert unpack_ids(pack_ids(view, "tokens"), "tokens").tolist() == view.tolist()
    with pytest.raises(ValueError, match="one-dimensional"):
        pack_ids(ids.reshape(4, 10), "tokens")


@pytest.mark.parametrize(
    ("values", "error", "fragment"),
    [
        ([[1, 2]], ValueError, "one-dimensional"),
        ([0.5], TypeError, "integers"),
        ([2**32], ValueError, "ids in [0, 2**32)"),
        ([-1], ValueError, "ids in [0, 2**32)"),
    ],
)
def test_pack_ids_rejects(values: list, error: type, fragment: str) -> None:
    with pytest.raises(error, match=re.escape(f"block_ids must be {fragment}")):
        pack_ids(values, "block_ids")


def test_unpack_ids_rejects_ragged_bytes() -> None:
    with pytest.raises(ProtocolError, match="'block_ids' must be packed uint32"):
        unpack_ids(b"\x01\x02\x03", "block_ids")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_decode_or_raise_protocol_error(payload: bytes) -> None:
    try:
        request = decode_request(payload)
    except ProtocolError:
        return
    with contextlib.suppress(ProtocolError):
        parse_args(request.op, request.args, request.id)
