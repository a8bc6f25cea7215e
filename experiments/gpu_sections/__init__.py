"""Sections of experiments/gpu_check.py that are an idea of their own (one module each)."""
