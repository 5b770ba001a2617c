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


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_npz_chunks_hold_exactly_the_arrays_of_a_stored_or_compressed_file(tmp_path, save):
    """Stored members (`np.savez`) are read straight from the file with their CRC-32 checked, compressed ones
    through zipfile: either way the chunks put together are the arrays `np.load` gives."""
    import fsspec

    from pipeline_lib.data.readers.npz import NpzReader, _StoredMember
    from pipeline_lib.data.sources import list_source

    rng = np.random.default_rng(3)
    arrays = {"x": rng.normal(size=(1037, 5)).astype(np.float32), "label": rng.integers(0, 4, size=1037),
              "w": rng.normal(size=1037)}
    path = tmp_path / "s.npz"
    save(path, **arrays)
    data = DataConfig(source=str(path), label="label")
    _fs, files = list_source(data)
    reader = NpzReader(fsspec.filesystem("file"), files[0], data)
    stream = reader._open(reader.members["x"])
    assert isinstance(stream, _StoredMember) == (save is np.savez)
    stream.close()
    chunks = list(reader.chunks(["x", "label", "w"], 100))
    assert [c.num_rows for c in chunks] == [100] * 10 + [37]
    for name, expected in arrays.items():
        np.testing.assert_array_equal(np.concatenate([c.columns[name] for c in chunks]), expected)
