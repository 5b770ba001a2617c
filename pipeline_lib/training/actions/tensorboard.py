"""A remote run's TensorBoard upload as the chief's loop action."""

from __future__ import annotations

from pipeline_lib.checkpoints.run_storage import RunStorage
from pipeline_lib.training.actions.base import LoopAction
from pipeline_lib.training.progress import ProgressLogger


class UploadTensorBoard(LoopAction):
    """Chief of a remote run (`run_storage.tensorboard_sync` set): after each progress line and at the end, flush the
    summary writer and upload the TensorBoard files that changed."""

    def __init__(self, progress: ProgressLogger, run_storage: RunStorage):
        self.progress, self.run_storage = progress, run_storage

    def after_log(self, step: int) -> None:
        self._upload()

    def close(self) -> None:
        self._upload()

    def _upload(self) -> None:
        self.progress.flush_summaries()
        self.run_storage.sync_tensorboard()
