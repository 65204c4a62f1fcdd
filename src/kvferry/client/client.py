"""`KvferryClient`: talk to a `kvferry server` from an engine process, synchronously or with futures.

    client = KvferryClient("tcp://127.0.0.1:5555")
    reg = client.register_kv_cache(kv_caches, EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, namespace={"model": "m"})
    hit = client.lookup(tokens, registration=reg).tokens
    stored = client.store(reg, tokens, block_ids)                # or client.store_async(...) -> Future[int]
    got = client.retrieve(reg, tokens, block_ids, skip_prefix_tokens=256)

After registration only token ids and block ids cross the socket; the server copies the KV itself.
Every `*_async` method returns a `concurrent.futures.Future`, resolved by whichever thread reads its reply (the
client's background thread, or a thread waiting in a plain method): keep `add_done_callback` callbacks short. The
plain methods wait for theirs reading the socket themselves, so a synchronous request crosses no other thread. A client
belongs to the process that made it: make it after any fork.

An engine never stalls on its cache server (see `kvferry.client.connection`): making a client does not wait for
the server; while the server is unreachable every request raises `ServerUnavailable` (a ConnectionError) at
once, and the client becomes usable again by itself once the server answers; no request waits longer than
`timeout_s` (TimeoutError), and the server never starts one its client has stopped waiting for. A server that
lost this client's registrations (it restarted) answers with `RegistrationLost`: register again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from kvferry.client.connection import Connection
from kvferry.client.done_flags import DoneFlags
from kvferry.client.errors import ServerError
from kvferry.client.fd_deposit import export_kv_to
from kvferry.client.ready_events import ReadyEvents
from kvferry.client.records import GpuRegistration, LocateResult, LookupResult, PrefetchStatus, Reserved
from kvferry.client.request_args import Namespace, demote_args, key_space_args, retrieve_args, store_args
from kvferry.client.transfers import Transfers
from kvferry.protocol.messages import Op, pack_ids
from kvferry.security import ClientCurve

CLOSE_TIMEOUT_S = 5.0  # the longest close() waits by default: ending the session, then the background thread


class KvferryClient:
    """A session with one server. Thread-safe; `close()` (or `with`) ends the session and frees its state."""

    def __init__(
        self, endpoint: str = "tcp://127.0.0.1:5555", *, timeout_s: float = 30.0, curve: ClientCurve | None = None
    ) -> None:
        """Start connecting to `endpoint` in the background; returns at once, server up or not. Requests then
        wait at most `timeout_s` for their reply; `wait_available()` waits for the server itself. `curve`: this
        client's CURVE keys and the server's (`SecurityConfig.client_curve`), for a server that asks for them (a
        Unix socket endpoint has none: its file's permissions decide)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._conn = Connection(
            endpoint, timeout_s=timeout_s, heartbeat_interval_s=1.0, silence_timeout_s=timeout_s, curve=curve
        )
        self._gpu: dict[int, GpuRegistration] = {}  # registrations of GPU KV in the server session now open
        self._transfers = Transfers(self._conn, self._gpu)

    @property
    def session_id(self) -> bytes:
        """This client's current session id (a new one after the server ended the previous session)."""
        return self._conn.session_id

    @property
    def chunk_size(self) -> int:
        """The server's chunk size in tokens (asked on first use: ServerUnavailable/TimeoutError if it cannot)."""
        hello = self._conn.hello if self._conn.hello is not None else self.ping()
        return int(hello["chunk_size"])

    @property
    def available(self) -> bool:
        """Whether the server answers now (False while connecting, and while it is unreachable)."""
        return self._conn.available

    def wait_available(self, timeout_s: float | None = None) -> bool:
        """Block until the server answers, at most `timeout_s` (default: the client's timeout); True if it did."""
        return self._conn.wait_available(self.timeout_s if timeout_s is None else timeout_s)

    def __enter__(self) -> KvferryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout_s: float | None = None) -> None:
        """End the session (the server frees its registrations and locks) and stop the background thread, within
        `timeout_s` in all (default: the client's timeout, at most CLOSE_TIMEOUT_S). Never waits for a server that
        is not answering: the server frees a session whose connection drops anyway."""
        wait_s = min(self.timeout_s, CLOSE_TIMEOUT_S) if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        try:
            if self._conn.available:
                self._conn.submit(Op.END_SESSION, {}).result(timeout=wait_s / 2)  # half: the rest is for the thread
        except (ServerError, ConnectionError, TimeoutError, FutureTimeout):
            pass  # the server is gone or going
        finally:
            self._transfers.close(deadline)
            self._conn.close(deadline)

    # -- requests -------------------------------------------------------------------------------------------

    def ping(self) -> dict[str, Any]:
        """The server's hello (protocol version, chunk size, limits, this session's id)."""
        hello = self._call(lambda: self._conn.submit(Op.PING, {}))
        self._conn.hello = hello
        return hello

    def get_chunk_size(self) -> int:
        return self._call(lambda: self._conn.submit(Op.GET_CHUNK_SIZE, {}, lambda r: int(r["chunk_size"])))

    def register_kv_cache(
        self,
        paged: Any,
        fmt: int,
        *,
        block_size: int | None = None,
        namespace: Namespace | None = None,
        heads: tuple[int, int] | None = None,
    ) -> int:
        """Share the engine's KV tensors with the server; returns the registration id.

        CPU tensors are moved into shared memory in place (every view keeps working); GPU tensors are shared
        by CUDA IPC handle, or driver-mapped ones (vLLM's extensible KV cache) by file descriptor over the server's
        Unix socket (an ``ipc://`` endpoint). `namespace` holds the key-space fields the server cannot see in the
        tensors (`kvferry.server.requests.Deployment`: model name, world size, rank, salt, codec, kv_cache_dtype, group,
        split). `heads=(first, total)`: the tensors hold heads `first ..` of the model's `total` KV heads (a
        tensor-parallel rank); the server's objects then hold every head, each rank writes and reads its slice,
        and engines of any parallelism share them (world size and rank are then not part of the key space).
        """
        storages, kv = export_kv_to(self._conn.endpoint, paged)
        args: dict[str, Any] = {
            "format": int(fmt),
            "block_size": block_size,
            "namespace": dict(namespace or {}),
            "storages": storages,
            "kv": kv,
        }
        if heads is not None:
            args["heads"] = [int(heads[0]), int(heads[1])]
        ready = flags = None
        if storages[0]["kind"] in ("cuda_ipc", "cuda_vmm_fd"):
            ready = ReadyEvents(_first_tensor(paged).device)
            args["ready_events"] = ready.handles()
            flags = DoneFlags()
            args["done_flags"] = flags.descriptor
        reg = self._call(lambda: self._conn.submit(Op.REGISTER_KV_CACHE, args, lambda r: int(r["registration"])))
        if ready is not None and flags is not None:
            self._gpu[reg] = GpuRegistration(ready.device, ready, flags)
        return reg

    def unregister_kv_cache(self, registration: int) -> None:
        self._gpu.pop(registration, None)
        self._call(lambda: self._conn.submit(Op.UNREGISTER_KV_CACHE, {"registration": registration}))

    def lookup(
        self,
        tokens: Any,
        *,
        registration: int | None = None,
        namespace: Namespace | None = None,
        lock: bool = False,
        block_size: int | None = None,
        first_chunk: int = 0,
        locate: bool = False,
    ) -> LookupResult:
        return self._call(
            lambda: self.lookup_async(
                tokens,
                registration=registration,
                namespace=namespace,
                lock=lock,
                block_size=block_size,
                first_chunk=first_chunk,
                locate=locate,
            )
        )

    def lookup_async(
        self,
        tokens: Any,
        *,
        registration: int | None = None,
        namespace: Namespace | None = None,
        lock: bool = False,
        block_size: int | None = None,
        first_chunk: int = 0,
        locate: bool = False,
    ) -> Future[LookupResult]:
        """Prefix tokens cached for `tokens` in the key space of `registration` (or an explicit `namespace`:
        a `kvferry.cache.CacheNamespace`'s fields, for a process that holds no KV): full chunks, then a stored
        tail of whole `block_size`-token blocks (any stored tail when None). `first_chunk`: only the chunks from
        this one on are needed (a sliding window's); the hit counts from token 0 as if those before it were held.
        `locate`: where the server would answer `locate_async` (and `first_chunk` is 0), the hit comes located
        (`LookupResult.located`) and its lock is that answer's lease; elsewhere a plain lookup. A server that
        predates it refuses the request (BAD_ARGUMENT)."""
        args = {"tokens": pack_ids(tokens, "tokens"), "lock": lock, **key_space_args(registration, namespace)}
        if block_size is not None:
            args["block_size"] = block_size
        if first_chunk:  # sent only when asked: a server that predates the field takes every other lookup
            args["first_chunk"] = first_chunk
        if locate:
            args["locate"] = True
        return self._conn.submit(Op.LOOKUP, args, _looked_up)

    def demote_async(
        self, tokens: Any, chunks: range, *, registration: int | None = None, namespace: Namespace | None = None
    ) -> Future[int]:
        """Chunks `chunks` of the prefix `tokens` go first when the server's cache evicts (they stay cached until
        then); resolves to how many of them `tokens` holds in full (the chunks asked about)."""
        args = demote_args(tokens, chunks, key_space_args(registration, namespace))
        return self._conn.submit(Op.DEMOTE, args, lambda r: int(r["chunks"]))

    def store(
        self,
        registration: int,
        tokens: Any,
        block_ids: Any,
        *,
        skip_prefix_tokens: int = 0,
        tail: bool = False,
        pages: bool = False,
    ) -> int:
        """`store_async`, waited for on this thread."""
        args = store_args(registration, tokens, block_ids, skip_prefix_tokens, tail, pages)
        return self._transfers.run(Op.STORE, registration, args)

    def store_async(
        self,
        registration: int,
        tokens: Any,
        block_ids: Any,
        *,
        skip_prefix_tokens: int = 0,
        tail: bool = False,
        pages: bool = False,
    ) -> Future[int]:
        """Copy the KV of `tokens` (held in `block_ids`) into the cache; resolves to the tokens stored, once the
        blocks may be reused. `tail`: the tokens after the last full chunk too, in whole blocks, as a tail object
        that a longer prompt's lookup hits (`kvferry.cache.tails`). `pages`: each chunk of `tokens` is a page keyed
        alone (`CacheEngine.store_steps`).

        For GPU KV the server first waits for the work queued so far on this thread's current CUDA stream,
        so the store may be issued right after the forward pass that wrote the blocks.
        """
        args = store_args(registration, tokens, block_ids, skip_prefix_tokens, tail, pages)
        return self._transfers.run_async(Op.STORE, registration, args)

    def retrieve(
        self,
        registration: int,
        tokens: Any,
        block_ids: Any,
        *,
        skip_prefix_tokens: int = 0,
        lock: int | None = None,
        pages: bool = False,
    ) -> int:
        """`retrieve_async`, waited for on this thread."""
        args = retrieve_args(registration, tokens, block_ids, skip_prefix_tokens, lock, pages)
        return self._transfers.run(Op.RETRIEVE, registration, args)

    def retrieve_async(
        self,
        registration: int,
        tokens: Any,
        block_ids: Any,
        *,
        skip_prefix_tokens: int = 0,
        lock: int | None = None,
        pages: bool = False,
    ) -> Future[int]:
        """Copy the cached KV of `tokens` into `block_ids`, leaving the blocks of the first
        `skip_prefix_tokens` tokens untouched; resolves to the tokens written, once the copy is complete
        (GPU included). `lock` (from `lookup(lock=True)`) is released when the copy ends. `pages`: each chunk of
        `tokens` is a page keyed alone (`CacheEngine.retrieve_steps`).

        For GPU KV the server's copy first waits, on the GPU, for the work queued so far on this thread's current
        CUDA stream, so the blocks may be handed to the load while kernels that still use them are queued there.
        """
        args = retrieve_args(registration, tokens, block_ids, skip_prefix_tokens, lock, pages)
        return self._transfers.run_async(Op.RETRIEVE, registration, args)

    def lookup_each_async(
        self,
        prompts: Sequence[Any],
        *,
        registration: int | None = None,
        namespace: Namespace | None = None,
        lock: bool = False,
        block_size: int | None = None,
    ) -> Future[list[LookupResult]]:
        """`lookup_async` of each of ``prompts`` (each alone: SGLang's pages), in one request; their results in order.
        A server that predates it refuses it (UNKNOWN_OP)."""
        args = {"prompts": [pack_ids(p, "tokens") for p in prompts], "lock": lock}
        args |= key_space_args(registration, namespace)
        if block_size is not None:
            args["block_size"] = block_size
        return self._conn.submit(
            Op.LOOKUP_EACH,
            args,
            lambda r: [LookupResult(int(f["tokens"]), int(f["pending"]), f["lock"]) for f in r["found"]],
        )

    def locate(
        self,
        tokens: Any,
        *,
        registration: int | None = None,
        namespace: Namespace | None = None,
        block_size: int | None = None,
    ) -> LocateResult:
        """`locate_async`, its reply read on this thread (no hand-off from the client's reader)."""
        return self._call(
            lambda: self.locate_async(tokens, registration=registration, namespace=namespace, block_size=block_size)
        )

    def locate_async(
        self,
        tokens: Any,
        *,
        registration: int | None = None,
        namespace: Namespace | None = None,
        block_size: int | None = None,
    ) -> Future[LocateResult]:
        """The pool's prefix hit of ``tokens`` where a server keeps a shared pool (``cache.shared_pool``): each
        object's place in it, under a lease this client ends with `free_lookup_locks` once it has copied them
        (`kvferry.client.pool_map` maps the pool). Refused (BAD_ARGUMENT) by a server whose pool is private, for
        coded objects or checksummed ones; FORBIDDEN to a tenant."""
        args = {"tokens": pack_ids(tokens, "tokens"), **key_space_args(registration, namespace)}
        if block_size is not None:
            args["block_size"] = block_size
        return self._conn.submit(Op.LOCATE, args, _located)

    def reserve_async(self, registration: int, count: int) -> Future[Reserved]:
        """``count`` objects of a whole chunk in the registered KV's object shape, reserved for this client in a
        server's shared pool (``cache.shared_pool``) to copy stores into itself (`kvferry.client.pool_map` maps the
        pool), then `commit_async`. Refused (BAD_ARGUMENT) by a server whose pool is private, for coded objects or
        a slice of the heads; FORBIDDEN to a tenant."""
        args = {"registration": registration, "count": count}
        return self._conn.submit(Op.RESERVE, args, _reserved)

    def commit_async(
        self,
        registration: int,
        tokens: Any,
        objects: list[int],
        *,
        first_chunk: int = 0,
        tail: tuple[int, int] | None = None,
        refill: int = 0,
    ) -> Future[Reserved]:
        """Reserved ``objects`` now hold the full chunks of ``tokens`` from ``first_chunk`` on, one each (``tail``:
        the offset and tokens of the one holding the whole blocks after them): the server indexes them as a
        STORE's, and reserves ``refill`` more. The result gives the tokens stored and the new objects."""
        args: dict[str, Any] = {
            "registration": registration,
            "tokens": pack_ids(tokens, "tokens"),
            "first_chunk": first_chunk,
            "objects": objects,
            "refill": refill,
        }
        if tail is not None:
            args["tail"] = list(tail)
        return self._conn.submit(Op.COMMIT, args, _reserved)

    def prefetch(self, tokens: Any, *, registration: int | None = None, namespace: Namespace | None = None) -> int:
        """Start bringing `tokens`' chunks from lower tiers into the host pool; returns a prefetch id."""
        args = {"tokens": pack_ids(tokens, "tokens"), **key_space_args(registration, namespace)}
        return self._call(lambda: self._conn.submit(Op.PREFETCH, args, lambda r: int(r["prefetch"])))

    def prefetch_status(self, prefetch: int) -> PrefetchStatus:
        """Whether prefetch `prefetch` finished; a finished one is forgotten by the server once reported."""
        return self._call(
            lambda: self._conn.submit(
                Op.PREFETCH_STATUS,
                {"prefetch": prefetch},
                lambda r: PrefetchStatus(bool(r["done"]), int(r["tokens"]), r.get("error")),
            )
        )

    def free_lookup_locks(self, lock: int) -> bool:
        """Release a lookup lock; False if the cache had already ended it (retrieve or timeout)."""
        return self._call(lambda: self.free_lookup_locks_async(lock))

    def free_lookup_locks_async(self, lock: int) -> Future[bool]:
        return self._conn.submit(Op.FREE_LOOKUP_LOCKS, {"lock": lock}, lambda r: bool(r["freed"]))

    def free_lookup_locks_many_async(self, locks: list[int]) -> Future[int]:
        """Release several lookup locks in one request; resolves to how many were still held (the others had ended,
        or are another client's)."""
        return self._conn.submit(Op.FREE_LOOKUP_LOCKS, {"locks": list(locks)}, lambda r: int(r["freed"]))

    def end_session(self) -> dict[str, Any]:
        """Release everything this session holds on the server; the client stays usable (a new session)."""
        self._gpu.clear()
        return self._call(lambda: self._conn.submit(Op.END_SESSION, {}))

    def clear(self) -> None:
        """Drop every object in the server's cache (all clients' objects)."""
        self._call(lambda: self._conn.submit(Op.CLEAR, {}))

    def stats(self) -> dict[str, Any]:
        return self._call(lambda: self._conn.submit(Op.STATS, {}))

    def _call(self, send: Callable[[], Future[Any]]) -> Any:
        """Send a request (`send` submits it) and wait for its result on this thread."""
        return self._conn.call(send)


def _reserved(reply: dict[str, Any]) -> Reserved:
    pool = reply.get("pool")
    pool_file = None if pool is None else (int(pool["pid"]), int(pool["fd"]), int(pool["bytes"]))
    return Reserved([int(offset) for offset in reply["objects"]], int(reply.get("stored", 0)), pool_file)


def _located(reply: dict[str, Any], tokens: int | None = None) -> LocateResult:
    """LOCATE's reply, or a located LOOKUP's ``located`` (its ``tokens`` the lookup's)."""
    pool = reply["pool"]
    objects = [(int(offset), int(n)) for offset, n in reply["objects"]]
    pool_file = (int(pool["pid"]), int(pool["fd"]), int(pool["bytes"]))
    tokens = int(reply["tokens"]) if tokens is None else tokens
    return LocateResult(tokens, reply["lease"], float(reply["deadline"]), objects, pool_file)


def _looked_up(reply: dict[str, Any]) -> LookupResult:
    tokens = int(reply["tokens"])
    located = reply.get("located")
    located_result = None if located is None else _located(located, tokens)
    return LookupResult(tokens, int(reply["pending"]), reply["lock"], located_result)


def _first_tensor(paged: Any) -> torch.Tensor:
    while not isinstance(paged, torch.Tensor):
        paged = paged[0]
    return paged
