"""``POST /v1/files``: a multipart/form-data upload streamed to the file store as it arrives
(never whole in memory). Every byte of the body counts — the file, the other fields, each
part's headers and boundaries — against the file size limit plus :data:`ENVELOPE_BYTES`: 413
as soon as it passes, whether or not it declared a ``Content-Length``. At most
:data:`MAX_PARTS` parts, each field other than the file at most :data:`MAX_FIELD_BYTES`."""

from __future__ import annotations

from typing import IO, Any

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from ..batch import Files
from ..batch.files import FileInfo, new_file_id
from .errors import ApiError, bad_request, too_large, unsupported_media_type

MAX_FIELD_BYTES = 4096  # a form field that is not the file (purpose, expires_after[...])
MAX_PARTS = 16  # the OpenAI SDK sends 2 to 4 (file, purpose, expires_after[anchor|seconds])
# what a body may hold besides the file: every other part at its largest, with its headers
# (python-multipart allows 8 header lines of at most 4 KiB per part) and boundaries
ENVELOPE_BYTES = MAX_PARTS * (MAX_FIELD_BYTES + 8 * 4224 + 512)


class _Receiver:
    """The parser's callbacks: the file part goes to ``out``, other fields to memory."""

    def __init__(self, out: IO[bytes], limit: int) -> None:
        self.out, self.limit = out, limit
        self.header_field = bytearray()
        self.header_value = bytearray()
        self.disposition = b""  # the current part's Content-Disposition
        self.name = ""  # the current part's field name
        self.value = bytearray()  # the current part's value (not the file)
        self.in_file = False  # the current part is the file
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.size = 0
        self.parts = 0

    def callbacks(self) -> Any:
        return {
            "on_part_begin": self.part_begin,
            "on_header_field": lambda d, s, e: self.header_field.extend(d[s:e]),
            "on_header_value": lambda d, s, e: self.header_value.extend(d[s:e]),
            "on_header_end": self.header_end,
            "on_headers_finished": self.headers_finished,
            "on_part_data": self.part_data,
            "on_part_end": self.part_end,
        }

    def part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise bad_request(f"more than {MAX_PARTS} parts in the upload")
        self.disposition, self.name, self.value, self.in_file = b"", "", bytearray(), False

    def header_end(self) -> None:
        if bytes(self.header_field).lower() == b"content-disposition":
            self.disposition = bytes(self.header_value)
        self.header_field.clear()
        self.header_value.clear()

    def headers_finished(self) -> None:
        _, params = parse_options_header(self.disposition)
        self.name = params.get(b"name", b"").decode("utf-8", "replace")
        filename = params.get(b"filename")
        if filename is not None and self.name == "file":
            if self.filename is not None:
                raise bad_request("more than one file in the upload", "file")
            self.filename = filename.decode("utf-8", "replace")
            self.in_file = True

    def part_data(self, data: bytes, start: int, end: int) -> None:
        n = end - start
        if self.in_file:
            self.size += n
            if self.size > self.limit:
                raise too_large(self.limit)
            self.out.write(data[start:end])
        elif len(self.value) + n <= MAX_FIELD_BYTES:
            self.value.extend(data[start:end])
        else:
            raise bad_request(f"form field {self.name!r} is too long", self.name)

    def part_end(self) -> None:
        if not self.in_file and self.name:
            self.fields[self.name] = self.value.decode("utf-8", "replace")


async def receive(request: Request, files: Files, limit: int, owner: str) -> FileInfo:
    """Stream the upload's ``file`` part into the store under a new file id and record it.
    Raises :class:`ApiError` (400, 413, 415); a failed upload leaves no file behind (the writer
    publishes the file only when its block ends without an error)."""
    header = request.headers.get("content-type")
    ctype, params = parse_options_header(header or "")
    if ctype != b"multipart/form-data":
        raise unsupported_media_type("multipart/form-data (with 'file' and 'purpose')", header)
    if not params.get(b"boundary"):
        raise bad_request("the multipart/form-data Content-Type names no boundary")
    most = limit + ENVELOPE_BYTES  # the whole body
    length = request.headers.get("content-length")
    if length and length.isascii() and length.isdigit() and int(length) > most:
        raise too_large(limit)
    file_id = new_file_id()
    try:
        with files.blobs.writer(file_id) as out:
            receiver = _Receiver(out, limit)
            parser = MultipartParser(params[b"boundary"], receiver.callbacks())
            seen = 0
            async for chunk in request.stream():
                seen += len(chunk)
                if seen > most:
                    raise too_large(limit)
                parser.write(chunk)
            parser.finalize()
            purpose = receiver.fields.get("purpose")
            if receiver.filename is None:
                raise bad_request("missing the 'file' part", "file")
            if purpose is None:
                raise bad_request("missing 'purpose'", "purpose")
            if purpose != "batch":
                raise bad_request(f"purpose must be 'batch' here, not {purpose!r}", "purpose")
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed body (python-multipart's own errors)
        raise bad_request(f"malformed multipart upload: {exc}") from None
    return files.add(file_id, receiver.filename, purpose, owner)
