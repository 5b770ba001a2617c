"""Runs gcp-storage-emulator with a byte-exact reader of multipart uploads (`python -m tests.stores.gcs_emulator_main
start --host ... --port ...`, the emulator's own command line).

The emulator reads a multipart upload with Python's email parser, which takes the line break before the closing
boundary to be CRLF when the content ends in a CR byte, and so drops that byte: one binary object in about 256
(a TFRecord shard, a checkpoint) came back one byte short. Real GCS keeps every byte; so does this reader, which
splits the body on the boundary and strips only the delimiter's own line break (RFC 2046).
"""

from __future__ import annotations

import base64
import json
import re
import sys

from gcp_storage_emulator import server
from gcp_storage_emulator.__main__ import main

_original_read_data = server._read_data


def _read_data(request_handler, query):
    content_type = request_handler.headers.get("Content-Type") or ""
    match = re.search(r'boundary="?([^";]+)"?', content_type)
    if not content_type.startswith("multipart/related") or not match:
        return _original_read_data(request_handler, query)
    raw = server._decode_raw_data(server._read_raw_data(request_handler), request_handler)
    if not raw:
        return None
    parts = []
    for chunk in raw.split(b"--" + match.group(1).encode())[1:-1]:
        newline = b"\r\n" if chunk.startswith(b"\r\n") else b"\n"
        head, _, body = chunk[len(newline):].partition(newline + newline)
        body = body.removesuffix(newline)  # the line break before the next delimiter is the delimiter's
        headers = dict(line.split(":", 1) for line in head.decode("latin-1").split(newline.decode()) if ":" in line)
        headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
        if headers.get("content-transfer-encoding", "").lower() == "base64":
            body = base64.b64decode(body)
        parts.append((headers, body))
    return {
        "meta": json.loads(parts[0][1]),
        "content": parts[1][1],
        "content-type": parts[1][0].get("content-type", "application/octet-stream").split(";")[0],
    }


server._read_data = _read_data

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
