"""The wire protocol between `kvferry server` and its clients.

One request or reply is one ZMQ frame holding one msgpack map (never pickle: a frame is data, not code):

    request  {"v": 1, "id": <int>, "op": "<Op>", "args": {...}[, "deadline": <unix seconds>]}
    reply    {"v": 1, "id": <int | None>, "ok": true, "result": {...}}
             {"v": 1, "id": <int | None>, "ok": false, "error": {"code": "<ErrorCode>", "message": "..."}}

Clients (ZMQ DEALER) pick request ids; the server (ROUTER) echoes them, so replies may arrive in any order.
A request's optional `deadline` (the server's clock, `time.time()`) is when its client stops waiting for it: the
server does not start a request past its deadline (DEADLINE_EXCEEDED), so a request a client has given up on --
and may have reused the blocks of -- is never carried out later.
A reply to a frame whose id could not be read carries id None. Token ids and block ids travel as packed
little-endian uint32 bytes (`pack_ids`), which is ~10x smaller and faster than msgpack lists of ints.
"""

from __future__ import annotations

import array
import sys
import threading
from enum import StrEnum
from typing import Any, NamedTuple

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
_ID_DTYPE = np.dtype("<u4")
_U32_CODE = next(code for code in "IL" if array.array(code).itemsize == 4)


class Op(StrEnum):
    """Request types. Arguments per op: `kvferry.server.requests`."""

    PING = "PING"
    GET_CHUNK_SIZE = "GET_CHUNK_SIZE"
    REGISTER_KV_CACHE = "REGISTER_KV_CACHE"
    UNREGISTER_KV_CACHE = "UNREGISTER_KV_CACHE"
    LOOKUP = "LOOKUP"
    LOOKUP_EACH = "LOOKUP_EACH"
    LOCATE = "LOCATE"
    RESERVE = "RESERVE"
    COMMIT = "COMMIT"
    STORE = "STORE"
    RETRIEVE = "RETRIEVE"
    PREFETCH = "PREFETCH"
    PREFETCH_STATUS = "PREFETCH_STATUS"
    FREE_LOOKUP_LOCKS = "FREE_LOOKUP_LOCKS"
    DEMOTE = "DEMOTE"
    END_SESSION = "END_SESSION"
    CLEAR = "CLEAR"
    STATS = "STATS"


_OPS = {op.value: op for op in Op}
_REQUEST_FIELDS = frozenset({"v", "id", "op", "args", "deadline"})


class ErrorCode(StrEnum):
    MALFORMED = "MALFORMED"  # not one frame holding a msgpack map with the envelope fields
    VERSION_MISMATCH = "VERSION_MISMATCH"
    UNKNOWN_OP = "UNKNOWN_OP"
    BAD_ARGUMENT = "BAD_ARGUMENT"  # the message names the argument and what was expected
    TOO_LARGE = "TOO_LARGE"
    # The session holds no such registration: it was never made in this session, was unregistered, or the
    # server forgot it (a server restart, or a session ended by disconnect or heartbeat timeout). Register the
    # KV again and use the new id; registration ids are never reused by another server process.
    UNKNOWN_REGISTRATION = "UNKNOWN_REGISTRATION"
    UNKNOWN_PREFETCH = "UNKNOWN_PREFETCH"
    UNKNOWN_LOCK = "UNKNOWN_LOCK"
    # The sender's session was ended by the server (its connection dropped, or it missed heartbeats) and the
    # request was not run: a session id is never reopened. Reconnect with a new id and register again.
    SESSION_ENDED = "SESSION_ENDED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # the request's deadline passed before it could start; not run
    SHUTTING_DOWN = "SHUTTING_DOWN"
    # The client's tenant may not do this: CLEAR and STATS reach every tenant's objects and counts
    FORBIDDEN = "FORBIDDEN"
    INTERNAL = "INTERNAL"  # a bug on the server side; the server logs the traceback


class ProtocolError(Exception):
    """A request the server answers with an error reply (raised on the server side)."""

    def __init__(self, code: ErrorCode, message: str, request_id: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


# Named tuples: made for every request and reply, and a tuple is made several times faster than a frozen dataclass.
class Request(NamedTuple):
    id: int
    op: Op
    args: dict[str, Any]
    deadline: float | None = None  # time.time() after which the client no longer waits for it


class Reply(NamedTuple):
    id: int | None
    ok: bool
    result: dict[str, Any]
    error_code: str = ""
    error_message: str = ""


_packers = threading.local()  # one Packer per thread: `packb` makes a new one per call (4x the time of a PING's)


def _pack(obj: dict[str, Any]) -> bytes:
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(obj)


def _unpack_map(payload: bytes | memoryview, what: str) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(payload)  # raw=False, strict_map_key=True: str keys and values, no other key types
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise ProtocolError(ErrorCode.MALFORMED, f"{what} is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.MALFORMED, f"{what} must be a msgpack map, got {type(obj).__name__}")
    return obj


def encode_request(op: Op, request_id: int, args: dict[str, Any], deadline: float | None = None) -> bytes:
    msg: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": request_id, "op": op.value, "args": args}
    if deadline is not None:
        msg["deadline"] = deadline
    return _pack(msg)


def decode_request(payload: bytes | memoryview) -> Request:
    """Parse a request frame; raises ProtocolError (with the request id when it could be read)."""
    msg = _unpack_map(payload, "request")
    request_id = msg.get("id")
    if type(request_id) is not int or not 0 <= request_id < 1 << 63:
        raise ProtocolError(ErrorCode.MALFORMED, f"request 'id' must be an int in [0, 2**63), got {request_id!r}")
    version = msg.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.VERSION_MISMATCH,
            f"request 'v'={version!r}, this server speaks protocol version {PROTOCOL_VERSION}",
            request_id,
        )
    name = msg.get("op")
    op = _OPS.get(name) if type(name) is str else None
    if op is None:
        raise ProtocolError(
            ErrorCode.UNKNOWN_OP,
            f"request 'op'={msg.get('op')!r} is not one of {[o.value for o in Op]}",
            request_id,
        )
    args = msg.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError(ErrorCode.MALFORMED, f"request 'args' must be a map, got {type(args).__name__}", request_id)
    # v, id and op are there: more fields than those and the optional two are there means an unknown one
    if len(msg) > 3 + ("args" in msg) + ("deadline" in msg):
        unknown = msg.keys() - _REQUEST_FIELDS
        raise ProtocolError(ErrorCode.MALFORMED, f"request has unknown fields {sorted(map(str, unknown))}", request_id)
    deadline = msg.get("deadline")
    if deadline is not None and (type(deadline) not in (int, float) or not deadline >= 0):
        raise ProtocolError(
            ErrorCode.MALFORMED, f"request 'deadline' must be unix seconds >= 0, got {deadline!r}", request_id
        )
    return Request(request_id, op, args, deadline)


def encode_result(request_id: int | None, result: dict[str, Any]) -> bytes:
    return _pack({"v": PROTOCOL_VERSION, "id": request_id, "ok": True, "result": result})


def encode_error(request_id: int | None, code: ErrorCode, message: str) -> bytes:
    return _pack(
        {
            "v": PROTOCOL_VERSION,
            "id": request_id,
            "ok": False,
            "error": {"code": code.value, "message": message},
        }
    )


def decode_reply(payload: bytes | memoryview) -> Reply:
    """Parse a reply frame (client side); raises ProtocolError on a frame no server of ours would send."""
    msg = _unpack_map(payload, "reply")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.VERSION_MISMATCH, f"reply 'v'={msg.get('v')!r}, expected {PROTOCOL_VERSION}")
    request_id = msg.get("id")
    if msg.get("ok") is True:
        return Reply(request_id, True, msg.get("result") or {})
    error = msg.get("error") or {}
    return Reply(request_id, False, {}, str(error.get("code", "")), str(error.get("message", "")))


def pack_ids(values: Any, name: str) -> bytes:
    """Token or block ids (a sequence, numpy array or CPU/GPU tensor of ints) as packed uint32 bytes."""
    if isinstance(values, list | tuple):  # what engines hand over; array.array packs a list 4x faster than numpy
        packed = array.array(_U32_CODE)
        try:
            # fromlist: 1.4x faster than the constructor (which sets item by item through the sequence protocol)
            packed.fromlist(values if isinstance(values, list) else list(values))
        except (OverflowError, TypeError):
            pass  # the checks below name the problem
        else:
            if sys.byteorder == "big":
                packed.byteswap()
            return packed.tobytes()
    if type(values) is np.ndarray and values.dtype == _ID_DTYPE and values.ndim == 1:  # what a prompt is kept as
        return values.tobytes()  # (`kvferry.cache.keys.token_array`): uint32 ids need no range check
    if hasattr(values, "detach"):  # a torch tensor: avoid importing torch just for isinstance
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(arr.shape)}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
        raise ValueError(f"{name} must be ids in [0, 2**32), got values in [{int(arr.min())}, {int(arr.max())}]")
    return arr.astype(_ID_DTYPE, copy=False).tobytes()


def unpack_ids(data: bytes, name: str) -> np.ndarray:
    """Inverse of `pack_ids`; raises ProtocolError naming the argument when the byte count is not whole."""
    if len(data) % _ID_DTYPE.itemsize:
        raise ProtocolError(
            ErrorCode.BAD_ARGUMENT,
            f"'{name}' must be packed uint32 (a multiple of 4 bytes), got {len(data)} bytes",
        )
    return np.frombuffer(data, dtype=_ID_DTYPE)
