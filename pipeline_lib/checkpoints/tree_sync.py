"""Mirroring a local directory to a remote one, uploading only the files that changed (TensorBoard logs)."""

from __future__ import annotations

import logging
import os
import posixpath
from typing import Any

from pipeline_lib.core import storage

logger = logging.getLogger(__name__)


class TreeSync:
    """Mirrors a local directory to a remote one, uploading only files that changed since the last sync.

    Object stores cannot append, so a grown event file is uploaded whole; TensorBoard logs are small.
    """

    def __init__(self, local_dir: str, remote_uri: str, storage_options: dict[str, Any] | None = None):
        self.local_dir = local_dir
        self.remote_uri = remote_uri.rstrip("/")
        self.fs, root = storage.get_fs(self.remote_uri, storage_options)
        self.root = root.rstrip("/")
        self._synced: dict[str, tuple[int, int]] = {}

    def sync(self) -> int:
        """Upload new and changed files; a failure is logged and retried at the next sync.

        Returns:
            The number of files uploaded.
        """
        if not os.path.isdir(self.local_dir):
            return 0
        uploaded = 0
        for relative in storage.iter_files(self.local_dir):
            source = os.path.join(self.local_dir, relative)
            try:
                stat = os.stat(source)
            except FileNotFoundError:
                continue
            version = (stat.st_size, stat.st_mtime_ns)
            if self._synced.get(relative) == version:
                continue
            target = f"{self.root}/{relative.replace(os.sep, '/')}"
            try:
                self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
                self.fs.put_file(source, target)
            except Exception as error:  # noqa: BLE001 - logs are best effort; the next sync catches up
                logger.warning("could not sync %s to %s (%s: %s); retrying at the next sync", relative,
                               self.remote_uri, type(error).__name__, error)
                continue
            self._synced[relative] = version
            uploaded += 1
        if uploaded:
            logger.debug("synced %d file(s) of %s to %s", uploaded, self.local_dir, self.remote_uri)
        return uploaded
