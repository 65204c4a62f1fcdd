"""Argument schemas of each request op, validated strictly so an error names the bad argument."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvferry.protocol.messages import ErrorCode, Op, ProtocolError

NonNegative = Annotated[int, Field(ge=0)]


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class NoArgs(_Args):
    pass


class ShmStorage(_Args):
    """A CPU storage in shared memory that the client holds open as descriptor `fd`, its bytes from `offset_bytes`:
    torch's file-descriptor sharing (`UntypedStorage._share_fd_cpu_()`: an unlinked /dev/shm file), or memory the
    engine allocated in a memfd or /dev/shm file (SGLang's ``shm`` host pool); the server maps
    `/proc/<pid>/fd/<fd>`.

    An unlinked file or a memfd has no name, so nothing is left in /dev/shm however the client or the server ends:
    the memory returns once the last process mapping it unmaps or exits.
    """

    kind: Literal["shm_fd"]
    pid: Annotated[int, Field(gt=0)]
    fd: NonNegative
    offset_bytes: NonNegative  # where the storage's bytes start in the file
    nbytes: NonNegative


class CudaIpcStorage(_Args):
    """A CUDA storage shared by IPC handle (the fields of `UntypedStorage._share_cuda_()`)."""

    kind: Literal["cuda_ipc"]
    device_uuid: str  # resolves the device across different CUDA_VISIBLE_DEVICES
    handle: bytes
    nbytes: NonNegative
    offset_bytes: NonNegative
    ref_counter_handle: bytes
    ref_counter_offset: NonNegative
    event_handle: bytes | None
    event_sync_required: bool


class CudaVmmStorage(_Args):
    """A CUDA allocation the driver's VMM calls mapped (vLLM's extensible KV cache), shared by POSIX file
    descriptor: descriptor `fd_index` of the deposit `token` on the server's descriptor socket
    (`kvferry.protocol.fd_passing`). The server maps the whole allocation; tensor views' offsets count from its
    start."""

    kind: Literal["cuda_vmm_fd"]
    device_uuid: str
    token: Annotated[bytes, Field(min_length=16, max_length=16)]
    fd_index: NonNegative
    nbytes: Annotated[int, Field(gt=0)]  # the allocation's size; the driver refuses a map past its end


class TensorView(_Args):
    """One engine KV tensor as a strided view of a shared storage (offset, shape and strides in elements)."""

    storage: NonNegative
    offset: NonNegative
    shape: list[NonNegative]
    stride: list[NonNegative]
    dtype: str


# A name within a deployment's key space (`kvferry.cache.CacheNamespace`): never empty, never a '|'.
KeyTag = Annotated[str, Field(min_length=1, pattern=r"^[^|]+$")]


class Deployment(_Args):
    """The key-space fields a registration cannot read off its tensors (dtype and layout it can)."""

    model: Annotated[str, Field(min_length=1)]
    world_size: Annotated[int, Field(ge=1)] = 1
    rank: NonNegative = 0
    salt: str = ""
    codec: Literal["none", "fp8"] | None = None  # the chunk objects' codec; None: the server's `cache.codec`
    kv_cache_dtype: KeyTag | None = None  # the engine's cache dtype where the tensors' does not name it (fp8)
    group: KeyTag | None = None  # a hybrid model's KV cache group
    split: KeyTag | None = None  # a part of a layer split


class Namespace(Deployment):
    """A whole key space (`kvferry.cache.CacheNamespace`), for clients that hold no KV (a scheduler)."""

    kv_dtype: Annotated[str, Field(min_length=1)]
    layout: Annotated[str, Field(min_length=1)]


class RegisterArgs(_Args):
    format: int
    block_size: Annotated[int, Field(gt=0)] | None = None
    namespace: Deployment
    storages: Annotated[list[ShmStorage | CudaIpcStorage | CudaVmmStorage], Field(min_length=1, max_length=4096)]
    kv: Any  # TensorView maps nested in lists, mirroring the format's nesting; checked by kv_mapping
    # CUDA IPC events the server opens once; a STORE or RETRIEVE names the one it recorded (`ready_slot`)
    ready_events: Annotated[list[bytes], Field(max_length=64)] | None = None
    # [first head, total heads]: the tensors hold that slice of the model's KV heads (a tensor-parallel rank);
    # objects then hold every head, and the key space is the model's whatever the parallelism
    heads: Annotated[list[NonNegative], Field(min_length=2, max_length=2)] | None = None
    # CUDA registrations: a page of 4-byte words the server's GPU writes when a transfer naming a slot is done
    done_flags: ShmStorage | None = None


class RegistrationArgs(_Args):
    registration: NonNegative


class LookupArgs(_Args):
    tokens: bytes
    lock: bool = False
    block_size: Annotated[int, Field(gt=0)] | None = None  # a stored tail counts in whole blocks of this size
    # The caller needs the chunks from this one on only (a sliding window's): the hit counts from token 0 as if
    # the chunks before it were held (`CacheEngine.lookup_pool`); absent: 0, every chunk
    first_chunk: NonNegative = 0
    # Locate the hit as LOCATE does (its read lease the lock), where this server and session can: a scheduler
    # hands the objects' places to the engine process that copies them, with no LOCATE on the load's path
    locate: bool = False
    registration: NonNegative | None = None  # the key space of that registration
    namespace: Namespace | None = None  # or an explicit one (scheduler processes hold no KV)


class LocateArgs(_Args):
    """A prefix's objects in the server's shared pool, for an engine on this host that copies them itself."""

    tokens: bytes
    block_size: Annotated[int, Field(gt=0)] | None = None
    registration: NonNegative | None = None
    namespace: Namespace | None = None


class ReserveArgs(_Args):
    """Objects of a whole chunk reserved in the server's shared pool for the asking session, to copy stores into."""

    registration: NonNegative  # the KV whose object shape they take
    count: Annotated[int, Field(gt=0, le=4096)]


class CommitArgs(_Args):
    """Reserved objects written with a store's full chunks from ``first_chunk`` on, one each (and a tail: its
    offset and tokens), to be indexed; ``refill`` more reserved in the same request."""

    registration: NonNegative
    tokens: bytes
    first_chunk: NonNegative = 0
    objects: list[NonNegative]  # byte offsets in the pool, as RESERVE gave them
    tail: Annotated[list[NonNegative], Field(min_length=2, max_length=2)] | None = None  # [offset, tokens]
    refill: Annotated[int, Field(ge=0, le=4096)] = 0


class LookupEachArgs(_Args):
    """Several prompts, each looked up alone as a LOOKUP of it would be (SGLang's pages: one a page)."""

    prompts: Annotated[list[bytes], Field(min_length=1, max_length=1 << 16)]
    lock: bool = False
    block_size: Annotated[int, Field(gt=0)] | None = None
    registration: NonNegative | None = None
    namespace: Namespace | None = None


class DemoteArgs(_Args):
    """Chunks ``first_chunk ..`` (``num_chunks`` of them, those past the tokens' full chunks ignored) of the
    prefix ``tokens`` go first when the cache evicts (`CacheEngine.demote`)."""

    tokens: bytes
    first_chunk: NonNegative = 0
    num_chunks: NonNegative
    registration: NonNegative | None = None
    namespace: Namespace | None = None


class TransferArgs(_Args):
    registration: NonNegative
    tokens: bytes
    block_ids: bytes
    skip_prefix_tokens: NonNegative = 0
    tail: bool = False  # STORE: the tokens after the last full chunk too, as a tail object (kvferry.cache.tails)
    # CUDA IPC event the server's copy waits for on the GPU before it reads (STORE) or writes (RETRIEVE) GPU KV
    ready_event: bytes | None = None
    ready_slot: NonNegative | None = None  # or: which of the registration's `ready_events` it recorded
    lock: NonNegative | None = None  # a LOOKUP lock that RETRIEVE ends once its copy is done
    pages: bool = False  # each chunk of tokens a page keyed alone (`CacheEngine.store_steps`, `retrieve_steps`)
    # with `pages`, instead of `tokens` (empty): each page's 32-byte key, its tokens (`kvferry.cache.page_keys`)
    page_keys: bytes | None = None
    # Answer once the copy is enqueued; the GPU writes `done_seq` into word `done_slot` of the registration's
    # `done_flags` when it is done (the client polls the word)
    done_slot: NonNegative | None = None
    done_seq: Annotated[int, Field(ge=1, lt=2**32)] | None = None


class PrefetchArgs(_Args):
    tokens: bytes
    registration: NonNegative | None = None
    namespace: Namespace | None = None


class PrefetchStatusArgs(_Args):
    prefetch: NonNegative


class FreeLocksArgs(_Args):
    """One lock (``lock``), or several freed together (``locks``: a lookup of pages takes one per page)."""

    lock: NonNegative | None = None
    locks: Annotated[list[NonNegative], Field(min_length=1, max_length=1 << 16)] | None = None


ARGS_BY_OP: dict[Op, type[_Args]] = {
    Op.PING: NoArgs,
    Op.GET_CHUNK_SIZE: NoArgs,
    Op.REGISTER_KV_CACHE: RegisterArgs,
    Op.UNREGISTER_KV_CACHE: RegistrationArgs,
    Op.LOOKUP: LookupArgs,
    Op.LOOKUP_EACH: LookupEachArgs,
    Op.LOCATE: LocateArgs,
    Op.RESERVE: ReserveArgs,
    Op.COMMIT: CommitArgs,
    Op.STORE: TransferArgs,
    Op.RETRIEVE: TransferArgs,
    Op.PREFETCH: PrefetchArgs,
    Op.PREFETCH_STATUS: PrefetchStatusArgs,
    Op.FREE_LOOKUP_LOCKS: FreeLocksArgs,
    Op.DEMOTE: DemoteArgs,
    Op.END_SESSION: NoArgs,
    Op.CLEAR: NoArgs,
    Op.STATS: NoArgs,
}


def parse_args(op: Op, args: dict[str, Any], request_id: int) -> Any:
    """Validate `args` for `op`; a ProtocolError(BAD_ARGUMENT) names each offending argument."""
    try:
        return ARGS_BY_OP[op].model_validate(args)
    except ValidationError as exc:
        problems = "; ".join(f"'{'.'.join(map(str, err['loc'])) or 'args'}': {err['msg']}" for err in exc.errors()[:5])
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"{op.value} {problems}", request_id) from None
