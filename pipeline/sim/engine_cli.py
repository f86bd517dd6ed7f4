"""The engine model's command-line options (``pipeline sim --engine PRESET ...``)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn

from .engine import POLICIES, PREEMPTION_MODES, EngineConfig
from .presets import PRESETS, engine_config

# EngineConfig fields an option overrides (the option is the field with dashes)
OVERRIDES = ("scheduling_policy", "preemption", "kv_cache_tokens", "max_num_seqs",
             "max_num_batched_tokens", "max_model_len", "enable_prefix_caching")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine model", (
        "a continuous-batching engine modelled on vLLM's scheduler (docs/development.md, "
        "'The engine model'); the options after --engine need it"))  # fmt: skip
    add = group.add_argument
    add("--engine", dest="engine_preset", choices=sorted(PRESETS), metavar="PRESET",
        help=f"answer through an engine model: {', '.join(sorted(PRESETS))}")  # fmt: skip
    add("--time-scale", type=_positive_float, default=1.0, metavar="S",
        help="every engine duration times S (0.1: ten times faster)")  # fmt: skip
    add("--scheduling-policy", choices=POLICIES,
        help="the engine's queue order (priority: the body's 'priority', lower first)")  # fmt: skip
    add("--preemption", choices=PREEMPTION_MODES, help="what a preempted sequence loses")
    for flag, what in [("--kv-cache-tokens", "the KV cache"),
                       ("--max-num-seqs", "running sequences at most"),
                       ("--max-num-batched-tokens", "tokens per step at most"),
                       ("--max-model-len", "prompt + max_tokens at most")]:  # fmt: skip
        add(flag, type=_positive_int, metavar="N", help=f"{what} (default: the preset's)")
    add("--enable-prefix-caching", action="store_true", default=None,
        help="cache prompt blocks by their prefix (vLLM's automatic prefix caching): a prompt "
        "whose leading blocks are cached skips their prefill")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> EngineConfig | None:
    """The engine the options describe (None without --engine); exit 2 naming a bad option."""
    given = {k: getattr(args, k) for k in OVERRIDES if getattr(args, k) is not None}
    if args.engine_preset is None:
        if given or args.time_scale != 1.0:
            flag = "--" + next(iter(given), "time_scale").replace("_", "-")
            _usage_error(f"{flag} needs --engine PRESET")
        return None
    for name in ("latency_ms", "jitter_ms", "itl_ms"):
        if getattr(args, name, 0):
            _usage_error(f"--{name.replace('_', '-')} does not apply with --engine")
    try:
        return engine_config(args.engine_preset, args.time_scale, **given)
    except ValueError as exc:
        _usage_error(f"--engine {args.engine_preset}: {exc}")


def _positive_float(text: str) -> float:
    """An argparse ``type``: a finite number above 0 (else exit 2 naming the option)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number above 0, not {text!r}")
    return value


def _positive_int(text: str) -> int:
    """An argparse ``type``: a whole number above 0 (else exit 2 naming the option)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a whole number above 0, not {text!r}")
    return value


def _usage_error(message: str) -> NoReturn:
    print(f"pipeline sim: error: {message}", file=sys.stderr)
    raise SystemExit(2)
