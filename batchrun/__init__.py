"""batchrun: offline batch LLM inference.

`import batchrun` stays light: heavy modules (torch, transformers) load on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"
