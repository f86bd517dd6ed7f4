"""The batch page at ``/``: every batch (of the caller's tenant, with API keys on) with a
progress bar, counts, status, age and ETA, refreshed every second from ``/ui/batches``
(``page.html``)."""

from functools import cache
from importlib import resources


@cache
def page() -> str:
    return (resources.files("pipeline.serve") / "page.html").read_text(encoding="utf-8")
