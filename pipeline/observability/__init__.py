"""Watching it run: Prometheus series (:mod:`.metrics`, :mod:`.collectors`), OpenTelemetry
spans (:mod:`.tracing`), the node's ``/metrics`` / ``/healthz`` / ``/readyz`` server
(:mod:`.health`) and the ``pipeline status`` view (:mod:`.status`). Imports ``config``,
``store``, ``gates``, ``client`` and ``errors`` of the pipeline."""
