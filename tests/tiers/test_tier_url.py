from pathlib import Path

import pytest

from kvferry.tiers import DiskTier, RedisTier, TierURLError, make_tier, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("200GB", 200 * 10**9),
        ("1.5TB", 15 * 10**11),
        ("512MiB", 512 * 2**20),
        ("4gib", 4 * 2**30),
        ("64 KiB", 65536),
        ("4096", 4096),
        ("10b", 10),
    ],
)
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "12XB", "-5GB", "0", "1e9", "5 G"])
def test_bad_sizes_say_what_a_size_looks_like(text: str) -> None:
    with pytest.raises(ValueError, match=r"size .* (is not a size|at least 1 byte)"):
        parse_size(text)


@pytest.mark.parametrize(("text", "expected"), [("2", 2.0), ("2s", 2.0), ("500ms", 0.5), ("0.25", 0.25)])
def test_durations(text: str, expected: float) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "0", "1h", "-1s", "fast"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_disk_url(tmp_path: Path) -> None:
    tier = make_tier(f"disk:{tmp_path}/c?size=3MiB&workers=2&direct=off&fsync=on&name=local&backoff=250ms")
    try:
        assert isinstance(tier, DiskTier)
        assert tier.name == "local" and tier.capacity_bytes == 3 * 2**20 and tier.direct is False
        assert tier.root == str(tmp_path / "c") and (tmp_path / "c").is_dir()
    finally:
        tier.close()


def test_disk_url_with_empty_authority_and_default_name(tmp_path: Path) -> None:
    tier = make_tier(f"disk://{tmp_path}?size=1GB")
    try:
        assert tier.name == f"disk:{tmp_path}" and tier.capacity_bytes == 10**9
    finally:
        tier.close()


def test_redis_urls_build_lazily_without_a_server() -> None:
    tier = make_tier("redis://user:secret@127.0.0.1:1/3?workers=1&timeout=200ms&connect_timeout=100ms&prefix=x:")
    try:
        assert isinstance(tier, RedisTier) and not tier.cluster
        assert tier.name == "redis://127.0.0.1:1/3" and "secret" not in tier.name
    finally:
        tier.close()
    cluster = make_tier("valkey+cluster://[::1]:7000,10.0.0.2?batch=4")
    try:
        assert cluster.cluster and cluster.name == "redis+cluster://::1:7000,10.0.0.2:6379"
    finally:
        cluster.close()


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("nothing", "has no scheme"),
        ("s3://bucket/x", "unknown scheme 's3'"),
        ("disk:/tmp/x", "needs size="),
        ("disk:?size=1GB", "has no directory"),
        ("disk://host/tmp/x?size=1GB", "local path, not host 'host'"),
        ("disk:/tmp/x?size=lots", "size 'lots' is not a size"),
        ("disk:/tmp/x?size=1GB&colour=red", "unknown parameter 'colour'; this tier takes size, workers"),
        ("disk:/tmp/x?size=1GB&size=2GB", "'size' given twice"),
        ("disk:/tmp/x?size=1GB&direct=maybe", "direct='maybe', expected auto, on or off"),
        ("disk:/tmp/x?size=1GB&workers=0", "workers='0' must be a whole number >= 1"),
        ("disk:/tmp/x?size=1GB&fsync=perhaps", "fsync='perhaps' must be on/off"),
        ("disk:/tmp/x?size=1GB&backoff=90", r"backoff \(90.0\) <= backoff_max"),
        ("redis:127.0.0.1", "expected //host:port"),
        ("redis://a:1,b:2", "lists 2 hosts; use redis\\+cluster://"),
        ("redis+cluster://a:1/0", "must be a database number \\(not for a cluster\\)"),
        ("redis://a:1/zero", "must be a database number"),
        ("redis://a:99999", "port 99999 is out of range"),
        ("redis://a:1?timeout=soon", "duration 'soon'"),
        ("redis://a:1?prefix=a{b", "must not contain"),
        ("redis://:hunter2@a:1?bogus=1", r"'redis://:\*\*\*@a:1\?bogus=1'.*unknown parameter 'bogus'"),
    ],
)
def test_bad_urls_get_clear_errors(url: str, match: str) -> None:
    with pytest.raises(TierURLError, match=match) as info:
        make_tier(url)
    assert "hunter2" not in str(info.value)
