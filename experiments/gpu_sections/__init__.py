"""The sections of experiments/gpu_check.py and what they share, one idea per module."""
