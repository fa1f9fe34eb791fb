"""batchrun: offline batch LLM inference.

`import batchrun` stays light: heavy modules (torch, transformers) load on first use.
"""

from __future__ import annotations

from batchrun._checkout_path import drop_checkout_from_path

__version__ = "0.1.0"

drop_checkout_from_path()
