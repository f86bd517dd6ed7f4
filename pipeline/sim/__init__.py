"""The OpenAI-compatible model-server simulator (``pipeline sim``): product code, used by the
demo, the tests and the benchmarks. Imports nothing of the pipeline."""

from .server import SimConfig, SimServer, add_arguments, run_from_args

__all__ = ["SimConfig", "SimServer", "add_arguments", "run_from_args"]
