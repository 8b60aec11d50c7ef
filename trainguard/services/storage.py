"""S3 access for checkpoints, manifests and dumps (any S3: SeaweedFS, MinIO, AWS).

Blocking boto3 calls; async callers run them in a thread. Every call has a
bounded connect/read timeout and a small retry budget so a storage outage shows
up as an error the caller can act on, not a hang.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from trainguard.services.settings import Settings

CHUNK = 8 * 1024 * 1024
# Up to this size a shard goes in one PutObject that carries its sha256 for the server to check;
# larger ones in parts (s3transfer's default threshold), with the sha256 as metadata.
ONE_PUT_MAX = 8 * 1024 * 1024


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str = ""


def _loopback(endpoint: str | None) -> bool:
    host = urlsplit(endpoint).hostname if endpoint else None
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class S3Store:
    def __init__(
        self, settings: Settings, connect_timeout_s: float = 5.0, read_timeout_s: float = 60.0
    ) -> None:
        self.bucket = settings.s3_bucket
        s3: dict[str, Any] = {"addressing_style": "path"}
        if _loopback(settings.s3_endpoint):
            # Nobody sits between us and a loopback endpoint: signing the body would hash every
            # shard once more (over TLS botocore leaves it out by itself when a checksum is sent).
            s3["payload_signing_enabled"] = False
        self._client = boto3.client(
            "s3",
            endpoint_url=settings.s3_endpoint,
            region_name=settings.s3_region,
            aws_access_key_id=settings.aws_access_key_id,
            aws_secret_access_key=(
                settings.aws_secret_access_key.get_secret_value() if settings.aws_secret_access_key else None
            ),
            config=Config(
                connect_timeout=connect_timeout_s,
                read_timeout=read_timeout_s,
                retries={"max_attempts": 3, "mode": "standard"},
                s3=s3,
            ),
        )

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def put_file(self, key: str, path: Path, sha256: str | None = None) -> tuple[int, str]:
        """Upload ``path`` to ``key``; returns (size, sha256) of what was sent. ``sha256``: the
        file's, when the writer hashed it already (it is not hashed again here)."""
        digest = sha256 or sha256_file(path)
        size = path.stat().st_size
        meta = {"Metadata": {"sha256": digest}}
        if size <= ONE_PUT_MAX:
            # The checksum header replaces botocore's own CRC32 of the body, and the server checks
            # the body against it: bytes that changed since they were hashed are refused.
            with path.open("rb") as body:
                self._client.put_object(
                    Bucket=self.bucket,
                    Key=key,
                    Body=body,
                    ChecksumSHA256=base64.b64encode(bytes.fromhex(digest)).decode(),
                    **meta,
                )
        else:
            self._client.upload_file(str(path), self.bucket, key, ExtraArgs=meta)
        return size, digest

    def get_file(self, key: str, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".part")
        self._client.download_file(self.bucket, key, str(tmp))
        tmp.replace(path)

    def put_json(self, key: str, data: Any) -> str | None:
        """Write ``data`` as JSON; returns the object's ETag."""
        r = self._client.put_object(
            Bucket=self.bucket,
            Key=key,
            Body=json.dumps(data, indent=1).encode(),
            ContentType="application/json",
        )
        return r.get("ETag")

    def get_json(self, key: str) -> Any | None:
        try:
            body = self._client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        return json.loads(body)

    def get_bytes(self, key: str) -> bytes | None:
        try:
            return self._client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise

    def head(self, key: str) -> ObjectInfo | None:
        try:
            r = self._client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        return ObjectInfo(key=key, size=int(r["ContentLength"]))

    def list(self, prefix: str, first: str = "", last: str = "") -> list[ObjectInfo]:
        """Objects under ``prefix``; with ``first``/``last``, only keys from ``first`` to ``last``
        (S3 lists in lexical order, so the listing starts at ``first`` and stops past ``last``:
        one group's shards of a step, not the whole step)."""
        out: list[ObjectInfo] = []
        # StartAfter is exclusive: ``first`` less its last character sorts just before it.
        start = {"StartAfter": first[:-1]} if first else {}
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix, **start
        )
        for page in pages:
            for o in page.get("Contents", []):
                key = o["Key"]
                if last and key > last:
                    return out
                if key >= first:
                    out.append(ObjectInfo(key=key, size=int(o["Size"]), etag=o.get("ETag", "")))
        return out

    def key_of(self, uri: str) -> str:
        """The key of an ``s3://`` URI of this store's bucket (the inverse of :meth:`uri`)."""
        head = f"s3://{self.bucket}/"
        if not uri.startswith(head):
            raise ValueError(f"{uri} is not in bucket {self.bucket}")
        return uri[len(head) :]

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
