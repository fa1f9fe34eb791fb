"""Quantized checkpoints: their formats (formats/), decoded into one layout (weights.py)."""
