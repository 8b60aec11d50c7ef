"""S3 access for checkpoints, manifests and dumps (any S3: SeaweedFS, MinIO, AWS).

Blocking boto3 calls; async callers run them in a thread. Every call has a
bounded connect/read timeout and a small retry budget so a storage outage shows
up as an error the caller can act on, not a hang.

On a machine, each job's files go through credentials of that job's alone (``JobStores``):
the agent assumes the job role (``TRAINGUARD_S3_JOB_ROLE``) with a session policy that cuts
the role's rights down to the job's two prefixes (its checkpoints, ``<s3_prefix>/<job>/``,
and its logs, ``jobs/<job>/logs/``), as AWS STS and SeaweedFS's both do (``AssumeRole`` with
``Policy``). Whatever an agent does for a job then lands under that job's prefixes, and another
job's objects can be neither listed, read, written nor deleted with them. Controllers keep
the bucket-wide credentials (manifests, pruning, any job's latest checkpoint).
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import boto3
import botocore.session
from botocore.config import Config
from botocore.credentials import Credentials, RefreshableCredentials
from botocore.exceptions import ClientError

from trainguard.domain.rank_logs import job_logs_prefix
from trainguard.services.settings import Settings

CHUNK = 8 * 1024 * 1024
# Up to this size a shard goes in one PutObject that carries its sha256 for the server to check;
# larger ones in parts (s3transfer's default threshold), with the sha256 as metadata.
ONE_PUT_MAX = 8 * 1024 * 1024
# A job's credentials last this long; botocore renews them in their last 15 minutes.
JOB_CREDENTIALS_S = 3600
JOB_STORES_KEPT = 64


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
        self,
        settings: Settings,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        credentials: Credentials | None = None,
    ) -> None:
        """``credentials``: other than the settings' (a job's, ``JobStores``)."""
        self.bucket = settings.s3_bucket
        s3: dict[str, Any] = {"addressing_style": "path"}
        if _loopback(settings.s3_endpoint):
            # Nobody sits between us and a loopback endpoint: signing the body would hash every
            # shard once more (over TLS botocore leaves it out by itself when a checksum is sent).
            s3["payload_signing_enabled"] = False
        self._client = _session(settings, credentials).client(
            "s3",
            endpoint_url=settings.s3_endpoint,
            region_name=settings.s3_region,
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

    def get_fileobj(self, key: str, f: BinaryIO) -> None:
        """Download ``key`` into the open file ``f``: the caller chose where and how it is opened
        (``trainguard.agent.rank_files``: a new file beside the one it replaces)."""
        self._client.download_fileobj(self.bucket, key, f)

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
        """Delete ``keys``; a key the store refused (``AccessDenied``) raises, never passes as gone."""
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            r = self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            if r.get("Errors"):
                e = r["Errors"][0]
                error = {"Code": e.get("Code", ""), "Message": f"{e.get('Key')}: {e.get('Message', '')}"}
                raise ClientError({"Error": error}, "DeleteObjects")


def _session(settings: Settings, credentials: Credentials | None) -> boto3.Session:
    """A boto3 session with ``credentials``, else the settings' (else boto3's own chain)."""
    if credentials is None:
        secret = settings.aws_secret_access_key
        return boto3.Session(
            aws_access_key_id=settings.aws_access_key_id,
            aws_secret_access_key=secret.get_secret_value() if secret else None,
        )
    core = botocore.session.get_session()
    core._credentials = credentials  # botocore's way in for refreshable credentials
    return boto3.Session(botocore_session=core)


def scope_policy(bucket: str, prefixes: list[str]) -> dict[str, Any]:
    """An IAM policy allowing objects under ``prefixes`` alone: read, write, delete, and listing
    only with one of them as the prefix."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
                "Resource": [f"arn:aws:s3:::{bucket}/{p}*" for p in prefixes],
            },
            {
                "Effect": "Allow",
                "Action": ["s3:ListBucket"],
                "Resource": [f"arn:aws:s3:::{bucket}"],
                "Condition": {"StringLike": {"s3:prefix": [f"{p}*" for p in prefixes]}},
            },
        ],
    }


def job_prefixes(job_id: str, ckpt_prefix: str) -> list[str]:
    """Where a job's agents write: its checkpoints (stacks and script checkpoints within) and its
    rank output."""
    return [f"{ckpt_prefix.rstrip('/')}/", job_logs_prefix(job_id)]


def assume_scoped(settings: Settings, session_name: str, prefixes: list[str]) -> RefreshableCredentials:
    """Credentials of the job role cut down to ``prefixes``, renewed before they expire."""
    role = settings.s3_job_role
    assert role is not None
    sts = _session(settings, None).client(
        "sts",
        endpoint_url=settings.s3_sts_endpoint or settings.s3_endpoint,
        region_name=settings.s3_region,
        config=Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 3, "mode": "standard"}),
    )
    policy = json.dumps(scope_policy(settings.s3_bucket, prefixes))

    def fetch() -> dict[str, str]:
        c = sts.assume_role(
            RoleArn=role, RoleSessionName=session_name, Policy=policy, DurationSeconds=JOB_CREDENTIALS_S
        )["Credentials"]
        return {
            "access_key": c["AccessKeyId"],
            "secret_key": c["SecretAccessKey"],
            "token": c["SessionToken"],
            "expiry_time": c["Expiration"].isoformat(),
        }

    return RefreshableCredentials.create_from_metadata(fetch(), fetch, "sts-assume-role")


class JobStores:
    """The store each job's files go through on this machine: scoped to the job's prefixes when
    a job role is configured, else the machine's own store for every job (the settings' rights)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._shared: S3Store | None = None
        self._jobs: OrderedDict[str, S3Store] = OrderedDict()

    def for_job(self, job_id: str, ckpt_prefix: str) -> S3Store:
        if self.settings.s3_job_role is None:
            if self._shared is None:
                self._shared = S3Store(self.settings)
            return self._shared
        key = f"{job_id}\0{ckpt_prefix}"
        store = self._jobs.get(key)
        if store is None:
            creds = assume_scoped(self.settings, f"tg-{job_id}", job_prefixes(job_id, ckpt_prefix))
            store = self._jobs[key] = S3Store(self.settings, credentials=creds)
            while len(self._jobs) > JOB_STORES_KEPT:
                self._jobs.popitem(last=False)
        self._jobs.move_to_end(key)
        return store
