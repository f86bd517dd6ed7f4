"""Celery settings for the pipeline's workers (``celery -A tasks worker`` reads these).

JSON only on the wire; late acks with a prefetch of one slot each, so a message is taken only
when a slot is free (on a Redis broker ``tasks.node`` consumes the pipeline's queues without
acks instead and disables prefetch: see ``PIPELINE_BROKER_ACKS``); task events when Flower
asks for them. The broker defaults to the
pipeline's Redis.
"""

import os

from pipeline.config import bool_env, celery_transport_options, celery_url, is_cluster, key_prefix
from pipeline.store.keys import celery_queue

# a ?password= (which redis-py reads) goes into the userinfo for kombu, whose parser raises on it
_redis = celery_url(os.environ.get("PIPELINE_REDIS_URL") or "redis://localhost:6379/0")

broker_url = celery_url(os.environ.get("CELERY_BROKER_URL") or _redis)
# On a Redis Cluster (which Celery cannot use) no result backend unless one is named: the
# pipeline's request record is the result (docs/production.md, "Redis Cluster")
_backend = os.environ.get("CELERY_RESULT_BACKEND")
result_backend = celery_url(_backend) if _backend else (None if is_cluster(_redis) else _redis)
broker_connection_retry_on_startup = True

task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
result_accept_content = ["json"]

task_acks_late = True
task_reject_on_worker_lost = False  # a lost attempt is requeued by the pipeline, not Celery
# A lost broker connection leaves running attempts running (Celery 6 will cancel them by
# default): each is fenced by its token and reports once Redis is back, or its lease lapses and
# the reaper requeues it (tests/chaos/test_redis_restart.py). Celery 5.7 still logs a
# CPendingDeprecationWarning about the default on every connection loss.
worker_cancel_long_running_tasks_on_connection_loss = False
worker_prefetch_multiplier = 1
task_track_started = False  # STARTED reaches Flower as an event; no extra backend write
# Task events (for Flower) cost a broker publish each, a share of a node's throughput
# (BENCHMARKS.md). Off by default, as in Celery: `pipeline flower` (and Flower's periodic
# enable_events) turns them on while someone watches. PIPELINE_TASK_EVENTS=1 (or `pipeline
# worker -E`) sends them always.
_events = bool_env(os.environ, "PIPELINE_TASK_EVENTS", False)
worker_send_task_events = _events
task_send_sent_event = False  # the dispatcher sends only what runs next: "received" is enough
result_expires = 24 * 3600
# One result backend (and its bounded connection pool: tasks/backend.py) per node, not one per
# thread as Celery's default: one per thread means thousands of backends and pools at a large
# -c, built while the slots fill (figures: BENCHMARKS.md)
result_backend_thread_safe = True
result_extended = False

task_default_queue = celery_queue("default", key_prefix())
# Longer than the longest attempt (request_timeout_s, 300 s by default) plus the time a
# message can wait for a slot; attempts are fenced by token, so a redelivery never runs twice.
# A sentinel:// list (Celery's syntax: sentinel://h1:26379;sentinel://h2:26379/0) names the
# master PIPELINE_REDIS_SENTINEL_MASTER: one setting for the broker, the result backend and the
# pipeline's own Redis (kombu and Celery read it as the `master_name` transport option).
_sentinel = celery_transport_options(os.environ.get("PIPELINE_REDIS_SENTINEL_MASTER"))
broker_transport_options = {"visibility_timeout": 3 * 3600, **_sentinel}
result_backend_transport_options = {"visibility_timeout": 3 * 3600, **_sentinel}

worker_hijack_root_logger = False
worker_redirect_stdouts = False
