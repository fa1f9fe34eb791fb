"""Checkpoint formats: each module reads one quant_method's quantization_config (`parse`) and
decodes its tensors into batchrun/quant/weights.py's layout (`Scheme.decode`)."""
