"""The engine model's presets (``pipeline sim --engine NAME``), each number with its source.
Times are real seconds (``time_scale`` 1); ``--time-scale S`` multiplies every duration by S.

Model facts used below: Llama-3.1-8B has 8.03 B parameters (16.1 GB in bf16) and 32 layers
of 8 KV heads x 128 dimensions, so 2 x 32 x 8 x 128 x 2 bytes = 128 KiB of KV cache per
token; Llama-3.1-70B has 70.6 B parameters (141 GB) and 80 such layers: 320 KiB per token.
A token of forward pass costs about 2 FLOP per parameter. vLLM gives the KV cache what is left
of ``gpu_memory_utilization`` (0.9) of the GPU's memory after the weights and the activations,
and on GPUs of 70 GiB and more defaults to ``--max-num-seqs 1024`` and
``--max-num-batched-tokens 8192`` for its API server (256 and 2048 below that)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .engine import EngineConfig


@dataclass(frozen=True, slots=True)
class Workload:
    """The requests a preset is described with (and ``bench/engine_model.py`` sends)."""

    prompt_tokens: int
    max_tokens: int
    completion_min_ratio: float = 1.0  # completion tokens drawn from [ratio x max_tokens, max]
    concurrency: tuple[int, ...] = ()  # the sweep's levels
    time_scale: float = 1.0  # what the bench runs it at, to fit this machine


@dataclass(frozen=True, slots=True)
class Preset:
    config: EngineConfig
    workload: Workload
    summary: str


H100 = Preset(
    EngineConfig(
        name="h100",
        # Fitted to llm-d PR #1865's sweep (Llama-3.1-8B, one H100, ~256 output tokens): the
        # least largest throughput error over its six concurrencies with this preset's
        # workload (bench/engine_model.py, -8 % ... +7 %). At concurrency 8 a token every
        # 7.4 ms (4.2 req/s x 256 tokens over 8 sequences); the weights alone take 16.1 GB /
        # 3.35 TB/s = 4.8 ms to read.
        step_base_s=0.00685,
        # Fitted likewise: the table's latency grows ~0.055 ms per step per extra sequence, of
        # which prefill (below) is 100 tokens / 256 steps x 0.04 ms = 0.016 ms.
        step_per_seq_s=0.000040,
        # 16 GFLOP per token at ~400 TFLOP/s effective (40 % of the H100's 989 dense bf16).
        step_per_prefill_token_s=0.000040,
        # 80 GiB x 0.9 = 72 GiB, less 15 GiB of weights and ~4 GiB of activations and CUDA
        # graphs: 53 GiB / 128 KiB per token = 434,176 tokens (27,136 blocks).
        kv_cache_tokens=434_176,
        max_num_seqs=1024,  # the sweep's --max-num-seqs (also vLLM's default on an H100)
        max_num_batched_tokens=8192,  # vLLM's API-server default on GPUs of >= 70 GiB
        max_model_len=131_072,  # Llama-3.1's context length
    ),
    # The table does not give its prompts; 100-token prompts, the table's 256 output tokens.
    Workload(100, 256, 1.0, (8, 64, 128, 192, 256, 512), time_scale=0.25),
    "Llama-3.1-8B on one H100 80 GB, calibrated to llm-d PR #1865's concurrency sweep",
)

KV_BOUND = Preset(
    EngineConfig(
        name="kv-bound",
        # An L4 (24 GB, 300 GB/s, 121 TFLOP/s dense bf16): reading 16.1 GB of weights per
        # step takes 54 ms.
        step_base_s=0.054,
        # Attention reads each sequence's KV every step: ~2,100 tokens x 128 KiB = 275 MB at
        # 300 GB/s = 0.92 ms, plus 16 GFLOP at ~60 TFLOP/s effective = 0.27 ms.
        step_per_seq_s=0.0012,
        step_per_prefill_token_s=0.00027,  # 16 GFLOP per token at ~60 TFLOP/s effective
        # 22.5 GiB x 0.9 = 20.2 GiB, less 15 GiB of weights and ~1.5 GiB of activations:
        # 3.75 GiB / 128 KiB = 30,720 tokens (1,920 blocks): ~13 sequences of 2,300 tokens.
        kv_cache_tokens=30_720,
        max_num_seqs=256,  # vLLM's default below 70 GiB
        max_num_batched_tokens=2048,  # likewise
        max_model_len=16_384,  # vLLM refuses a max_model_len the cache cannot hold once
    ),
    # RAG-like: 2,000-token prompts, answers of 128-512 tokens.
    Workload(2000, 512, 0.25, (1, 4, 8, 12, 16, 24, 32, 64), time_scale=0.02),
    "Llama-3.1-8B on one L4 24 GB with long prompts: the KV cache is the limit",
)

COMPUTE_BOUND = Preset(
    EngineConfig(
        name="compute-bound",
        # Llama-3.1-70B on four H100s (tensor parallel 4): 141 GB of weights over 4 x 3.35
        # TB/s is 10.5 ms at peak; ~20 ms a step with the all-reduces.
        step_base_s=0.020,
        step_per_seq_s=0.00008,  # 140 GFLOP per token at 4 x ~450 TFLOP/s effective
        step_per_prefill_token_s=0.00007,  # likewise, a little better used in a prefill
        # 4 x 80 GiB x 0.9 = 288 GiB, less 131.5 GiB of weights and ~10 GiB of activations:
        # 146 GiB / 320 KiB = 478,400 tokens (29,900 blocks).
        kv_cache_tokens=478_400,
        # set as a deployment would, so that the cache (~310 sequences of 1,532 tokens)
        # never fills: what bounds it is the arithmetic of the prefills
        max_num_seqs=256,
        max_num_batched_tokens=8192,  # vLLM's API-server default on GPUs of >= 70 GiB
        max_model_len=131_072,
    ),
    # Prefill-heavy (classification, extraction): 1,500-token prompts, 32 output tokens.
    Workload(1500, 32, 1.0, (1, 4, 16, 32, 64, 128, 256, 512), time_scale=0.05),
    "Llama-3.1-70B on four H100s, prefill-heavy: compute is the limit",
)

PRESETS: dict[str, Preset] = {p.config.name: p for p in (H100, KV_BOUND, COMPUTE_BOUND)}


def engine_config(name: str, time_scale: float = 1.0, **overrides: object) -> EngineConfig:
    """The preset ``name`` at ``time_scale`` with the given :class:`EngineConfig` fields
    replaced (``None`` values ignored); ValueError naming what is wrong."""
    if name not in PRESETS:
        raise ValueError(f"unknown engine preset {name!r}: one of {sorted(PRESETS)}")
    config = PRESETS[name].config
    changes = {k: v for k, v in overrides.items() if v is not None}
    if "kv_cache_tokens" in changes and "max_model_len" not in changes:
        kv = changes["kv_cache_tokens"]
        if isinstance(kv, int) and kv < config.model_len:
            changes["max_model_len"] = 0  # the smaller cache's size
    try:
        config = dataclasses.replace(config, **changes)  # type: ignore[arg-type]
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    return config.scaled(time_scale) if time_scale != 1.0 else config
