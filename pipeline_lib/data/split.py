"""The deterministic train/eval split: a hash of each row's values and the seed, and the eval mask from it."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import crc32c as _crc32c
import numpy as np

from pipeline_lib.config import SplitConfig
from pipeline_lib.core import native
from pipeline_lib.data.encoding import string_column

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(h: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """splitmix64's finalizer, in place on `h`: a bijective avalanche on uint64 (wrapping arithmetic is intended)."""
    scratch = np.empty_like(h) if scratch is None else scratch
    for shift, multiplier in ((_S30, _M1), (_S27, _M2)):
        np.right_shift(h, shift, out=scratch)
        h ^= scratch
        h *= multiplier
    np.right_shift(h, _S31, out=scratch)
    h ^= scratch
    return h


def _words(values: Any) -> np.ndarray:
    """A (rows, k) view of a column's words for hashing: number bits, or crc32c and length of strings.

    uint64, except a float32 column of odd width: its uint32 bits, each one word (zero-extended), uncopied.
    """
    if isinstance(values, np.ndarray):
        if values.dtype == np.float32:
            bits = np.ascontiguousarray(values.reshape(len(values), -1)).view(np.uint32)
            return bits.view(np.uint64) if bits.shape[1] % 2 == 0 else bits
        return values.reshape(len(values), -1).astype(np.int64, copy=False).view(np.uint64)
    data, starts, lengths = string_column(values)
    if native.module is not None:
        words = np.empty(len(starts), dtype=np.uint64)
        native.module.string_words(data, np.ascontiguousarray(starts, np.int64),
                                   np.ascontiguousarray(lengths, np.int64), words)
        return words.reshape(-1, 1)
    view = memoryview(data)
    crc = _crc32c.crc32c
    digests = np.fromiter((crc(view[s : s + n]) for s, n in zip(starts.tolist(), lengths.tolist())),
                          dtype=np.uint64, count=len(starts))
    return (digests | (lengths.astype(np.uint64) << np.uint64(32))).reshape(-1, 1)


def _name_word(name: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))


def split_hash(columns: dict[str, Any], seed: int) -> np.ndarray:
    """A uint64 hash of each row from the given columns (in order) and the seed; depends on nothing else.

    Args:
        columns: name → converted values (numpy numbers, or an Arrow string/binary array).
        seed: data.split.seed.

    Returns:
        One uint64 per row.
    """
    num_rows = len(next(iter(columns.values())))
    scratch = np.empty(num_rows, dtype=np.uint64)
    h = _mix(np.full(num_rows, np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ np.uint64(0x9E3779B97F4A7C15)), scratch)
    in_c = native.module is not None
    for name, values in columns.items():
        words = _words(values)
        if in_c:  # the same fold, the name's word first, in one C loop, row by row
            native.module.split_hash(h, np.ascontiguousarray(words), words.shape[1], int(_name_word(name)))
            continue
        h ^= _name_word(name)
        _mix(h, scratch)
        # Word-major: each step reads one contiguous row of words instead of a strided column.
        for word in words.T.astype(np.uint64):
            h ^= word
            _mix(h, scratch)
    return h


def eval_mask(hashes: np.ndarray, eval_fraction: float) -> np.ndarray:
    """Rows whose top 32 hash bits fall below eval_fraction · 2^32 go to eval."""
    threshold = np.uint64(round(eval_fraction * (1 << 32)))
    return (hashes >> np.uint64(32)) < threshold


def hashed_columns(split: SplitConfig, features: Sequence[str], label: str) -> list[str]:
    """The columns a row's split is hashed from: `split.key_columns` when set, else every feature and the label."""
    return list(split.key_columns) if split.key_columns else sorted([*features, label])
