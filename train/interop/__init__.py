"""Weights, runs and HF Marian models between formats; each module loads both frameworks (imported on demand)."""
