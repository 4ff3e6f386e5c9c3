"""Block keys: chain hashes of token blocks, tenant salts, pool keys.

h_i = H(h_{i-1}, tokens of block i) - the chain hash of a block names the
whole prefix up to and including it.  The pool key of a block is
xxh3-128(namespace digest || tenant salt || h_i), so two namespaces (models,
dtypes, layouts) or two tenants never share a key.

Algorithms:

* ``xxh3_128`` (default): h_i = xxh3-128(h_{i-1} || tokens as little-endian
  uint32), h_{-1} = 16 zero bytes; computed in C over the whole sequence.
* ``sha256_cbor``: vLLM's prefix-cache hash - h_i = sha256(CBOR([h_{i-1},
  [tokens...], null])) with h_{-1} = vLLM's NONE_HASH = sha256(CBOR(seed))
  where seed is the PYTHONHASHSEED string - so a vLLM connector can key
  blocks by the hashes vLLM computed itself.

Keys never depend on Python's hash() or on the process: the same tokens give
the same keys on every host.
"""
from __future__ import annotations

import array
import hashlib
import hmac
import os

import numpy as np
import xxhash

from cxlkv import _core
from cxlkv.errors import UsageError

HASHES = ("xxh3_128", "sha256_cbor")
_U32 = next(c for c in "IL" if array.array(c).itemsize == 4)
MAX_TOKEN = 2**32 - 1


def tokens_array(tokens) -> np.ndarray:
    """Token ids as a contiguous little-endian uint32 array, or UsageError.

    Accepts a list/tuple of ints or an integer numpy array (any shape is
    flattened); ids must lie in [0, 2**32)."""
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        raise UsageError("tokens must be a sequence of integer token ids, not "
                         f"{type(tokens).__name__}")
    if isinstance(tokens, np.ndarray):
        arr = tokens.reshape(-1)
    elif isinstance(tokens, (list, tuple)):
        try:                                   # fast path: ints in range (4x numpy's)
            return np.frombuffer(array.array(_U32, tokens), dtype="<u4")
        except (TypeError, OverflowError, ValueError):
            try:                                      # the checks below say what is wrong
                arr = np.asarray(tokens).reshape(-1)
            except (TypeError, ValueError):
                arr = np.zeros(0, dtype=object)
            if arr.dtype == object:
                raise UsageError("tokens must be a flat sequence of integer token ids") from None
    else:
        try:
            arr = np.asarray(tokens if isinstance(tokens, (list, tuple)) else list(tokens))
        except (TypeError, ValueError):
            raise UsageError("tokens must be a sequence of integer token ids") from None
        arr = arr.reshape(-1)
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
        raise UsageError(f"tokens must be integers (got {arr.dtype} values)")
    if arr.dtype.kind == "i" and int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN:
        raise UsageError(f"token ids must lie in [0, {MAX_TOKEN}]")
    return np.ascontiguousarray(arr, dtype="<u4")


def xxh3_chain(tokens: np.ndarray, block_tokens: int) -> np.ndarray:
    """Chain hashes of the full blocks, shape (blocks, 16) uint8."""
    n = len(tokens) // block_tokens
    out = np.empty((n, 16), dtype=np.uint8)
    if n:
        _core.kv_chain(tokens[:n * block_tokens], block_tokens, out)
    return out


def _cbor_dumps(obj) -> bytes:
    import cbor2

    return cbor2.dumps(obj, canonical=True)


def vllm_none_hash(hash_seed: str | None) -> bytes:
    """vLLM's NONE_HASH for sha256_cbor: sha256(CBOR(seed)), seed = PYTHONHASHSEED.

    Without a seed vLLM draws a random one per process, so its keys would
    match nothing on another host: refuse instead."""
    seed = hash_seed if hash_seed is not None else os.environ.get("PYTHONHASHSEED")
    if seed is None:
        raise UsageError("sha256_cbor keys need vLLM's hash seed: set PYTHONHASHSEED (as for "
                         "vLLM) or pass hash_seed=; without it keys differ on every host")
    return hashlib.sha256(_cbor_dumps(str(seed))).digest()


def sha256_cbor_chain(tokens: np.ndarray, block_tokens: int, none_hash: bytes) -> np.ndarray:
    """vLLM-compatible chain hashes of the full blocks, shape (blocks, 32) uint8."""
    n = len(tokens) // block_tokens
    out = np.empty((n, 32), dtype=np.uint8)
    parent = none_hash
    blocks = tokens[:n * block_tokens].reshape(n, block_tokens).tolist() if n else []
    for i, toks in enumerate(blocks):
        parent = hashlib.sha256(_cbor_dumps((parent, tuple(toks), None))).digest()
        out[i] = np.frombuffer(parent, dtype=np.uint8)
    return out


def namespace_digest(name: str) -> bytes:
    return xxhash.xxh3_128_digest(b"cxlkv-namespace\0" + name.encode("utf-8"))


def derive_salt(secret: bytes, salt) -> bytes:
    """The tenant's real salt: HMAC-SHA256 of the caller's salt under the
    pool's secret (16 bytes).  None -> the unsalted tenant (all zeros)."""
    if salt is None:
        return bytes(16)
    if isinstance(salt, str):
        salt = salt.encode("utf-8")
    elif isinstance(salt, (bytes, bytearray, memoryview)):
        salt = bytes(salt)
    else:
        raise UsageError(f"salt must be str or bytes, not {type(salt).__name__}")
    if not salt:
        raise UsageError("salt must not be empty (use salt=None for no tenant)")
    return hmac.new(secret, b"cxlkv-tenant\0" + salt, hashlib.sha256).digest()[:16]


def pool_keys(chain: np.ndarray, ns_digest: bytes, salt16: bytes) -> np.ndarray:
    """Pool keys for chain hashes (rows of `chain`), shape (blocks, 16) uint8."""
    n = len(chain)
    out = np.empty((n, 16), dtype=np.uint8)
    if n:
        _core.kv_keys(np.ascontiguousarray(chain), chain.shape[1], ns_digest + salt16, out)
    return out
