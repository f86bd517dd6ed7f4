"""Batches as first-class objects: OpenAI's Batch object and file formats, stored in Redis
(:mod:`.records`, the ``batch_*.lua`` scripts), fed from an input (:mod:`.ingest`, checked by
:mod:`.lines`), read back in OpenAI's output format or ``pipeline run``'s (:mod:`.output`),
with files (:mod:`.files`) and the ``pipeline run`` client (:mod:`.run`). :class:`Batches`
(:mod:`.service`) is the entry point. Imports ``client``, ``store``, ``config`` and
``errors`` of the pipeline."""

from .config import BatchSettings
from .files import FileInfo, Files, FileStore, LocalFileStore
from .model import FINAL, STATUSES, Batch, RequestCounts, UnknownBatch, UnknownFile
from .service import Batches, content_batch_id, new_batch_id

__all__ = [
    "FINAL",
    "STATUSES",
    "Batch",
    "BatchSettings",
    "Batches",
    "FileInfo",
    "FileStore",
    "Files",
    "LocalFileStore",
    "RequestCounts",
    "UnknownBatch",
    "UnknownFile",
    "content_batch_id",
    "new_batch_id",
]
