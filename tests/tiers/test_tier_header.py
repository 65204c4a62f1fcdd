import struct

import pytest
import torch

from kvferry.tiers.header import (
    CHECKSUM_BYTES,
    CorruptObject,
    check_key,
    decode_header,
    destination_bytes,
    encode_header,
    note_key,
    noted_key,
    tensor_bytes,
    verify_payload,
)
from tests.tiers.tierkit import random_tensor, same_bits

KEY = b"model/ns/0123"
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int8, torch.float8_e4m3fn]


def _object(obj: torch.Tensor, align: int = 1) -> bytes:
    payload = tensor_bytes(obj)
    return encode_header(KEY, obj, payload, align=align) + bytes(payload)


def _decode(data: bytes) -> torch.Tensor:
    header = decode_header(KEY, data)
    payload = memoryview(data)[header.header_len :]
    verify_payload(header, payload)
    out = torch.empty(header.shape, dtype=header.dtype)
    destination_bytes(out, header)[:] = payload
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("align", [1, 4096])
def test_round_trip_is_bit_exact(dtype: torch.dtype, align: int) -> None:
    obj = random_tensor((2, 3, 16, 40), dtype, seed=7)
    data = _object(obj, align)
    assert decode_header(KEY, data).header_len % align == 0
    assert same_bits(_decode(data), obj)


def test_every_single_bit_flip_in_header_or_payload_is_caught() -> None:
    obj = random_tensor((1, 2, 4, 8), torch.bfloat16, seed=1)
    data = bytearray(_object(obj))
    for bit in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptObject):
            _decode(bytes(flipped))


def test_a_header_only_checksum_catches_every_header_bit_and_no_payload_bit() -> None:
    """For stores that guarantee whole reads (the Mooncake tier's default): the checksum covers the header, and a
    flipped flag (which would skip or demand the payload's sum) is caught like any other header bit."""
    obj = random_tensor((1, 2, 4, 8), torch.bfloat16, seed=1)
    data = bytearray(encode_header(KEY, obj, tensor_bytes(obj), payload_checksum=False) + bytes(tensor_bytes(obj)))
    header = decode_header(KEY, data)
    assert not header.payload_checksum and same_bits(_decode(bytes(data)), obj)
    for bit in range(header.header_len * 8):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptObject):
            _decode(bytes(flipped))
    flipped = bytearray(data)
    flipped[header.header_len + 5] ^= 1
    assert not same_bits(_decode(bytes(flipped)), obj)  # what it trades: a damaged payload is read as stored
    struct.pack_into("<H", data, 10, 0x8001)
    with pytest.raises(CorruptObject, match="unknown flags 0x8001"):
        decode_header(KEY, data)


def test_truncated_object_is_corrupt_at_every_length() -> None:
    data = _object(random_tensor((2, 1, 4, 16), torch.float16, seed=2))
    for length in range(len(data)):
        with pytest.raises(CorruptObject):
            _decode(data[:length])


def test_object_under_another_key_is_rejected() -> None:
    data = _object(random_tensor((4, 4), torch.uint8, seed=3))
    with pytest.raises(CorruptObject, match="key tag"):
        decode_header(b"other-key", data)


def test_unknown_version_is_rejected_with_reason() -> None:
    data = bytearray(_object(random_tensor((4, 4), torch.uint8, seed=3)))
    struct.pack_into("<H", data, 4, 99)
    with pytest.raises(CorruptObject, match="format version 99"):
        decode_header(KEY, data)


def test_checksum_covers_header_fields() -> None:
    """A shape with the same element count but other dims must not pass as the original."""
    obj = random_tensor((2, 8), torch.uint8, seed=4)
    data = bytearray(_object(obj))
    header = decode_header(KEY, data)
    shape_at = len(header.body) - 16
    struct.pack_into("<2Q", data, shape_at, 8, 2)
    reparsed = decode_header(KEY, data)
    assert reparsed.shape == (8, 2)
    with pytest.raises(CorruptObject, match="checksum"):
        verify_payload(reparsed, memoryview(data)[reparsed.header_len :])
    assert len(header.checksum) == CHECKSUM_BYTES


def test_payload_view_is_zero_copy() -> None:
    obj = random_tensor((64,), torch.bfloat16, seed=5)
    view = tensor_bytes(obj)
    obj[0] = 1.5
    assert bytes(view[:2]) == obj[:1].view(torch.uint8).numpy().tobytes()
    assert view.readonly


@pytest.mark.parametrize(
    ("obj", "error", "match"),
    [
        (b"bytes", TypeError, "torch.Tensor"),
        (torch.zeros(4, 4).t(), ValueError, "contiguous"),
        (torch.zeros(2, dtype=torch.complex64), ValueError, "not storable"),
        (torch.tensor(1.0), ValueError, "dim"),
    ],
)
def test_bad_objects_are_rejected_with_a_named_reason(obj: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        tensor_bytes(obj)


@pytest.mark.parametrize("bad", [b"", "text", None, 5])
def test_keys_must_be_nonempty_bytes(bad: object) -> None:
    with pytest.raises(TypeError, match="key must be non-empty bytes"):
        check_key(bad)


def test_destination_of_wrong_shape_is_refused() -> None:
    data = _object(random_tensor((4, 4), torch.float16, seed=6))
    header = decode_header(KEY, data)
    with pytest.raises(ValueError, match=r"alloc\(\(4, 4\), torch.float16\) returned \(16,\)"):
        destination_bytes(torch.empty(16, dtype=torch.float16), header)


def test_a_key_noted_in_the_padding_is_read_back_and_changes_nothing_for_readers() -> None:
    obj = random_tensor((3, 5), torch.float16, seed=4)
    payload = tensor_bytes(obj)
    plain = encode_header(KEY, obj, payload, align=4096)
    noted = note_key(plain, KEY)
    assert len(noted) == len(plain) and noted != plain
    assert noted_key(noted) == KEY and noted_key(plain) is None
    assert same_bits(_decode(noted + bytes(payload)), obj)  # the padding is not read
    forged = note_key(encode_header(b"another key", obj, payload, align=4096), KEY)
    assert noted_key(forged) is None  # the note must match the key tag
    assert note_key(encode_header(KEY, obj, payload), KEY) == encode_header(KEY, obj, payload)  # no padding: no room
