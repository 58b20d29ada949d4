"""The pool's calls packed: a batch request and its tokens as msgpack bytes on the wire.

Ray pickles an argument or a result it does not know with cloudpickle, one object at a time: for a
batch of tokens (msgspec structs) that is most of what an acquire or a release costs beyond Ray's
own round trip (``bench/ray_pool.py``). Packed, each call moves one bytes object, which Ray copies
as it is. ``PoolClient`` always packs; the service answers a packed request packed and also takes
the Structs themselves from a caller holding the actor's handle (the Ray tests).
"""

from __future__ import annotations

import msgspec

from rayapp.core.units import PoolError
from rayapp.types import BatchRequest, Token

_ENCODER = msgspec.msgpack.Encoder()
_TOKENS = msgspec.msgpack.Decoder(list[Token])
_REQUEST = msgspec.msgpack.Decoder(BatchRequest)


def pack(value: BatchRequest | list[Token]) -> bytes:
    return _ENCODER.encode(value)


def _unpacked(value, decoder: msgspec.msgpack.Decoder, where: str, noun: str):
    """``value`` as sent: packed bytes are decoded (and checked by their type), anything else passes."""
    if not isinstance(value, bytes):
        return value
    try:
        return decoder.decode(value)
    except msgspec.DecodeError as e:
        raise PoolError(f"{where}: the packed {noun} did not decode: {e}") from None


def unpack_tokens(tokens: list[Token] | bytes, where: str) -> list[Token]:
    """Tokens as sent: packed bytes are decoded (and checked), a list passes as it is."""
    return _unpacked(tokens, _TOKENS, where, "tokens")


def unpack_request(request: BatchRequest | bytes) -> BatchRequest:
    return _unpacked(request, _REQUEST, "acquire_batch", "request")
