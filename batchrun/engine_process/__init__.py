"""The engine in its own process (see client.py for the surface, worker.py for the loop)."""

from batchrun.engine_process.client import EngineProcess, EngineProcessError

__all__ = ["EngineProcess", "EngineProcessError"]
