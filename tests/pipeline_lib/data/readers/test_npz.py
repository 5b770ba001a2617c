"""The NPZ reader checks each member's CRC while streaming it."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline_lib.config import DataConfig
from pipeline_lib.data.convert import convert
from pipeline_lib.data.errors import ConversionError


def test_a_damaged_npz_member_fails_its_crc_and_writes_nothing(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.arange(4000, dtype=np.float32).reshape(1000, 4), label=np.arange(1000) % 3)
    damaged = bytearray(path.read_bytes())
    damaged[2000] ^= 0xFF  # inside the values of x.npy, past its header
    path.write_bytes(bytes(damaged))
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=r"d\.npz array 'x' is damaged: Bad CRC-32.*save the file again"):
        convert(DataConfig(source=str(path), label="label", read_chunk_rows=100), str(out))
    assert not (out / "data").exists() or not any((out / "data").rglob("*.tfrecord*"))
