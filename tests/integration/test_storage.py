"""Shard uploads reuse the hash their writer computed, and the S3 server checks the bytes against it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from trainguard.services.settings import Settings
from trainguard.services.storage import S3Store

pytestmark = pytest.mark.integration


def test_put_file_with_the_writers_hash_is_checked_by_the_server(settings: Settings, tmp_path: Path) -> None:
    store = S3Store(settings)
    path = tmp_path / "shard.pt"
    data = os.urandom(300_000)
    path.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    prefix = f"test-storage-{os.getpid()}"
    try:
        assert store.put_file(f"{prefix}/a", path, digest) == (len(data), digest)
        back = tmp_path / "back.pt"
        store.get_file(f"{prefix}/a", back)
        assert back.read_bytes() == data
        # Bytes that changed after they were hashed (or a wrong hash) are refused, not stored.
        with pytest.raises(ClientError, match="BadDigest"):
            store.put_file(f"{prefix}/b", path, hashlib.sha256(b"other").hexdigest())
        assert store.head(f"{prefix}/b") is None
        # Without a hash the store computes it.
        assert store.put_file(f"{prefix}/c", path) == (len(data), digest)
    finally:
        store.delete([f"{prefix}/{k}" for k in "abc"])
