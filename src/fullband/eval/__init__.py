"""Evaluation: validation loss by decoding mode (and, later, the paper's diagnostics)."""
