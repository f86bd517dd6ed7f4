"""Watching it run: Prometheus series, spans, the node's endpoint and ``pipeline status``
(docs/observability.md; what it may import: docs/architecture.md)."""
