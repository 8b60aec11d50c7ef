"""The payload codec: what Temporal stores is ciphertext that only the same key opens."""

from __future__ import annotations

import base64
import dataclasses

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import pydantic_data_converter

from trainguard.domain.job_state import JobInput
from trainguard.domain.spec import parse_spec
from trainguard.services.codec import ENCODING, EncryptionCodec, PayloadKeyError, new_key, parse_key

SECRET = "hf_TOPSECRET_0123456789"


def job_input() -> JobInput:
    spec = parse_spec(
        {
            "name": "gpt-tiny",
            "entrypoint": ["python", "train.py"],
            "nodes": 1,
            "target_steps": 10,
            "env": {"HF_TOKEN": SECRET},
            "secret_env": ["HF_TOKEN"],
        }
    )
    return JobInput(spec=spec)


def codec(key: str | None = None) -> EncryptionCodec:
    return EncryptionCodec(parse_key(key or new_key()))


async def test_a_payload_round_trips_and_its_bytes_hold_no_secret() -> None:
    converter = dataclasses.replace(pydantic_data_converter, payload_codec=codec())
    inp = job_input()
    encoded = await converter.encode([inp])
    wire = b"".join(p.SerializeToString() for p in encoded)
    assert SECRET.encode() not in wire
    assert b"HF_TOKEN" not in wire and b"gpt-tiny" not in wire  # metadata and names too
    assert encoded[0].metadata["encoding"] == ENCODING
    (decoded,) = await converter.decode(encoded, [JobInput])
    assert decoded == inp
    assert decoded.spec.env["HF_TOKEN"] == SECRET


async def test_the_same_payload_encrypts_differently_each_time() -> None:
    c = codec()
    p = Payload(metadata={"encoding": b"json/plain"}, data=b'{"a": 1}')
    first, second = await c.encode([p]), await c.encode([p])
    assert first[0].data != second[0].data
    assert await c.decode(first) == [p] == await c.decode(second)


async def test_a_wrong_key_fails_clearly() -> None:
    right, wrong = codec(), codec()
    encoded = await right.encode([Payload(data=SECRET.encode())])
    with pytest.raises(PayloadKeyError, match="TRAINGUARD_PAYLOAD_KEY") as exc:
        await wrong.decode(encoded)
    assert right.key_id.decode() in str(exc.value) and wrong.key_id.decode() in str(exc.value)
    assert SECRET not in str(exc.value)


async def test_an_altered_payload_is_refused() -> None:
    c = codec()
    (enc,) = await c.encode([Payload(data=b"step 812")])
    flipped = bytearray(enc.data)
    flipped[20] ^= 1
    altered = Payload(metadata=dict(enc.metadata), data=bytes(flipped))
    with pytest.raises(PayloadKeyError, match="authentication"):
        await c.decode([altered])
    with pytest.raises(PayloadKeyError, match="truncated"):
        await c.decode([Payload(metadata=dict(enc.metadata), data=enc.data[:10])])


async def test_payloads_written_before_a_key_was_set_still_decode() -> None:
    plain = Payload(metadata={"encoding": b"json/plain"}, data=b"1")
    assert await codec().decode([plain]) == [plain]


async def test_empty_payloads_round_trip() -> None:
    c = codec()
    assert await c.decode(await c.encode([Payload()])) == [Payload()]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not base64 at all!", "not base64"),
        (base64.b64encode(b"short").decode(), "at least 32"),
        ("", "at least 32"),
    ],
)
def test_unusable_keys_are_refused_naming_the_setting(text: str, message: str) -> None:
    with pytest.raises(PayloadKeyError, match=message) as exc:
        parse_key(text)
    assert str(exc.value).startswith("TRAINGUARD_PAYLOAD_KEY:")


def test_keys_are_accepted_in_either_base64_alphabet_with_surrounding_whitespace() -> None:
    raw = bytes(range(250, 256)) * 6  # encodes with '+', '/' or '-', '_'
    assert parse_key(base64.b64encode(raw).decode() + "\n") == raw
    assert parse_key(base64.urlsafe_b64encode(raw).decode().rstrip("=")) == raw


def test_the_codec_repr_shows_the_key_id_only() -> None:
    key = new_key()
    c = codec(key)
    assert key not in repr(c) and c.key_id.decode() in repr(c)


# Computed with the hand-written HKDF the codec had before it used cryptography's: payloads
# written then must still open, under the same key id.
PINNED_KEY = bytes(range(32))
PINNED_DERIVED = "b7e3466c36d86ae5098b28e262f8487b09794025a7aae80665c4023591ce13de"
PINNED_KEY_ID = b"a02ee291ccd319a7"
PINNED_SEALED = "000000000000000000000000c719670bd6438562e585afc433e18ff1bbc6957766c8e75e41650dd62f82"


def test_key_derivation_is_byte_identical_to_the_pinned_vector() -> None:
    from trainguard.services.codec import _hkdf

    assert _hkdf(PINNED_KEY, b"trainguard payload encryption").hex() == PINNED_DERIVED
    assert EncryptionCodec(PINNED_KEY).key_id == PINNED_KEY_ID
    assert EncryptionCodec(bytes(range(40))).key_id == b"91bd6e11f979911a"  # a longer key too
    assert EncryptionCodec(PINNED_KEY).open(bytes.fromhex(PINNED_SEALED)) == b"pinned payload"
