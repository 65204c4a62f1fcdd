"""Local disk tier: one file per object under a directory, written behind by a pool of worker threads.

Files are written under a temporary name and renamed into place, so a reader (in this or another process)
sees a whole object or none; a file cut short by a crash or a full disk fails verification and is deleted.
Names are `<2 hex>/<blake3(key) hex>.kvf`. Capacity is enforced by LRU-by-access eviction (see DiskIndex);
a restarted process rebuilds its index from the directory. A full filesystem (ENOSPC) makes puts return
False; the tier stays healthy for reads. Any other I/O error marks the tier unhealthy until a probe succeeds.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import blake3
import torch

from kvferry.tiers.base import Alloc, Free, Tier, TierFull, TierUnavailable, resolved
from kvferry.tiers.direct_io import (
    BLOCK,
    open_object,
    padded_size,
    read_head,
    read_into,
    supports_direct,
    unlink_quietly,
    write_object,
)
from kvferry.tiers.disk_index import OBJECT_SUFFIX, TEMP_SUFFIX, DiskIndex
from kvferry.tiers.header import (
    CorruptObject,
    decode_header,
    destination_bytes,
    encode_header,
    note_key,
    noted_key,
    verify_payload,
)

_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class DiskTier(Tier):
    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        workers: int = 4,
        direct: bool | None = None,
        fsync: bool = False,
        name: str | None = None,
        backoff_s: float = 1.0,
        backoff_max_s: float = 60.0,
    ) -> None:
        """`direct`: None uses O_DIRECT if the filesystem takes it, True requires it, False never uses it.
        `workers` threads write and as many read. `fsync` makes each put durable before it reports True."""
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.root = os.path.abspath(root)
        super().__init__(name or f"disk:{self.root}", backoff_s=backoff_s, backoff_max_s=backoff_max_s)
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"disk tier directory {self.root!r} cannot be created: {exc}") from exc
        try:
            _probe_write(self.root)
        except OSError as exc:
            raise ValueError(f"disk tier directory {self.root!r} is not writable: {exc.strerror}") from exc
        can_direct = supports_direct(self.root)
        if direct and not can_direct:
            raise ValueError(f"direct=True but the filesystem of {self.root!r} does not accept O_DIRECT")
        self.direct = can_direct if direct is None else direct
        self._fsync = fsync
        self._capacity = capacity_bytes
        self._index = DiskIndex(capacity_bytes)
        self._remove_files(self._index.scan(self.root))
        self._writers = ThreadPoolExecutor(workers, thread_name_prefix="kvferry-disk-write")
        self._readers = ThreadPoolExecutor(workers, thread_name_prefix="kvferry-disk-read")
        self._report_usage()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    def evict(self, nbytes: int) -> int:
        evicted = self._index.evict(nbytes)
        self._remove_files(evicted)
        self._report_usage()
        return sum(size for _, size in evicted)

    def stats(self) -> dict[str, object]:
        return {**super().stats(), "objects": len(self._index), "direct": self.direct}

    def close(self) -> None:
        super().close()
        self._writers.shutdown(wait=True)
        self._readers.shutdown(wait=True)

    # --- put ----------------------------------------------------------------------------------------------

    def _submit_put(self, key: bytes, obj: torch.Tensor, payload: memoryview) -> Future[bool]:
        try:
            return self._writers.submit(self._put_worker, key, obj, payload)
        except RuntimeError:  # closed meanwhile
            return resolved(False)

    def _put_worker(self, key: bytes, obj: torch.Tensor, payload: memoryview) -> bool:
        started = time.perf_counter()
        try:
            result, nbytes = self._write(key, obj, payload)
        except Exception as exc:
            self._record_failure("put", _classify(exc))
            return False
        self._record_success("put", result, nbytes, started)
        return True

    def _write(self, key: bytes, obj: torch.Tensor, payload: memoryview) -> tuple[str, int]:
        name = _object_name(key)
        path = os.path.join(self.root, name)
        if name not in self._index and (size := _file_size(path)) is not None:
            self._index.touch(name, size)  # another process wrote it
            return "exists", 0
        header = note_key(encode_header(key, obj, payload, align=BLOCK), key)  # a restart can tell what it holds
        size = padded_size(len(header), len(payload))
        evicted = self._index.begin_write(name, size)
        if evicted is None:
            return "exists", 0
        self._remove_files(evicted)
        temp = f"{path}.{os.getpid()}.{threading.get_ident()}{TEMP_SUFFIX}"
        stored = False
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_object(temp, header, payload, direct=self.direct, fsync=self._fsync)
            os.rename(temp, path)
            _touch(path)
            if self._fsync:
                _fsync_dir(os.path.dirname(path))
            stored = True
        finally:
            self._index.end_write(name, size, stored=stored)
            if not stored:
                unlink_quietly(temp)
            self._report_usage()
        return "stored", len(payload)

    # --- get ----------------------------------------------------------------------------------------------

    def _submit_get(self, key: bytes, alloc: Alloc, free: Free | None) -> Future[torch.Tensor | None]:
        try:
            return self._readers.submit(self._get_worker, key, alloc, free)
        except RuntimeError:
            return resolved(None)

    def _get_worker(self, key: bytes, alloc: Alloc, free: Free | None) -> torch.Tensor | None:
        started = time.perf_counter()
        try:
            tensor, result, nbytes = self._read(key, alloc, free)
        except CorruptObject as exc:
            self._record_corrupt(key, exc)
            return None
        except Exception as exc:
            self._record_failure("get", _classify(exc))
            return None
        self._record_success("get", result, nbytes, started)
        return tensor

    def _read(self, key: bytes, alloc: Alloc, free: Free | None) -> tuple[torch.Tensor | None, str, int]:
        name = _object_name(key)
        path = os.path.join(self.root, name)
        try:
            fd = open_object(path, direct=self.direct)
        except FileNotFoundError:
            self._index.remove(name)
            self._forget([name])
            return None, "miss", 0
        try:
            size = os.fstat(fd).st_size
            header = decode_header(key, read_head(fd))
            expected = padded_size(header.header_len, header.payload_len)
            if header.header_len % BLOCK or size != expected:
                raise CorruptObject(f"file is {size} bytes, its header says {expected} (cut short?)")
            tensor = alloc(header.shape, header.dtype)
            if tensor is None:
                return None, "no_memory", 0
            try:
                dst = destination_bytes(tensor, header)
                read_into(fd, header.header_len, dst, direct=self.direct)
                verify_payload(header, dst)
            except BaseException:
                if free is not None:
                    free(tensor)
                raise
        finally:
            os.close(fd)
        self._index.touch(name, size)
        with contextlib.suppress(FileNotFoundError):  # evicted meanwhile: what was read is still whole
            _touch(path)
        return tensor, "hit", header.payload_len

    # --- contains / delete --------------------------------------------------------------------------------

    def _contains(self, keys: list[bytes]) -> list[bool]:
        """Asks the filesystem, not just the index: other processes sharing the directory add and evict."""
        found = []
        for key in keys:
            name = _object_name(key)
            try:
                size = _file_size(os.path.join(self.root, name))
            except OSError as exc:
                raise _classify(exc) from exc
            if size is None:
                self._index.remove(name)
                self._forget([name])
            elif name not in self._index:
                self._index.touch(name, size)
                if self._held is not None:  # another process wrote it
                    self._held.add(name, key)
            found.append(size is not None)
        return found

    def _check(self) -> bool:
        try:
            _probe_write(self.root)
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                return True  # full, but there: a full disk refuses puts and stays healthy for reads
            raise TierUnavailable(f"{self.root} is not writable: {exc.strerror}") from exc
        return True

    def _delete(self, key: bytes) -> None:
        name = _object_name(key)
        self._index.remove(name)
        self._forget([name])
        try:
            unlink_quietly(os.path.join(self.root, name))
        except OSError as exc:
            raise _classify(exc) from exc
        self._report_usage()

    def _remove_files(self, evicted: list[tuple[str, int]]) -> None:
        for name, _ in evicted:
            unlink_quietly(os.path.join(self.root, name))
        if evicted:
            self._metrics.evicted(len(evicted))
            self._forget([name for name, _ in evicted])

    def _object_name(self, key: bytes) -> str:
        return _object_name(key)

    def _objects_held(self) -> dict[str, bytes]:
        """Reads the head of every object file for the key written into it (files of older builds hold none)."""
        held = {}
        for name in self._index.names():
            try:
                fd = open_object(os.path.join(self.root, name), direct=self.direct)
            except OSError:
                continue  # evicted or deleted meanwhile
            try:
                key = noted_key(read_head(fd))
            except OSError:
                key = None
            finally:
                os.close(fd)
            if key is not None:
                held[name] = key
        return held

    def _report_usage(self) -> None:
        self._metrics.set_usage(self._index.used_bytes, self._capacity)


def _object_name(key: bytes) -> str:
    digest = blake3.blake3(key).hexdigest()
    return f"{digest[:2]}/{digest}{OBJECT_SUFFIX}"


def _classify(exc: Exception) -> Exception:
    if isinstance(exc, OSError):
        if exc.errno in _FULL_ERRNOS:
            return TierFull(str(exc))
        return TierUnavailable(str(exc))
    return exc


def _probe_write(directory: str) -> None:
    """Create and remove an empty file in ``directory``: what a put needs, whoever runs it (root too)."""
    path = os.path.join(directory, f".write-probe-{os.getpid()}-{threading.get_ident()}")
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600))
    os.unlink(path)


def _file_size(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def _touch(path: str) -> None:
    """Stamp the file's mtime with the exact time: it orders LRU eviction, also after a restart (the
    filesystem's own timestamps are only as fine as the kernel tick)."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
