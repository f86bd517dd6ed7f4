"""The OpenAI-compatible model-server simulator (``pipeline sim``): product code, used by the
demo, the tests and the benchmarks. Imports nothing of the pipeline. With an engine
(``SimConfig(engine=engine_config("h100", time_scale=0.1))``) it answers through a model of a
continuous-batching engine (:mod:`pipeline.sim.engine`)."""

from .engine import Engine, EngineConfig
from .presets import PRESETS, engine_config
from .server import SimConfig, SimServer, add_arguments, run_from_args

__all__ = [
    "PRESETS",
    "Engine",
    "EngineConfig",
    "SimConfig",
    "SimServer",
    "add_arguments",
    "engine_config",
    "run_from_args",
]
