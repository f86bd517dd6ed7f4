"""Batches as first-class objects (OpenAI's Batch object and file formats) stored in Redis;
:class:`Batches` is the entry point. How they work: docs/batches.md."""

from .config import BatchSettings
from .files import Files, FileStore, LocalFileStore
from .model import Batch, FileElsewhere, IngestFailed, RequestCounts, UnknownBatch, UnknownFile
from .service import Batches, content_batch_id

__all__ = [
    "Batch",
    "BatchSettings",
    "Batches",
    "FileElsewhere",
    "FileStore",
    "Files",
    "IngestFailed",
    "LocalFileStore",
    "RequestCounts",
    "UnknownBatch",
    "UnknownFile",
    "content_batch_id",
]
