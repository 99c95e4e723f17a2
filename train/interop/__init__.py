"""Weights, runs and pretrained models between formats, for the library itself (`--init-from` of a
Marian model or of the other framework's run) and for `parity`'s commands and proofs: the leaf
rules between the twins (`weights`), whole runs and weights files (`runs`), HF Marian (`marian`).
Each module loads both frameworks; nothing here is imported until a conversion is asked for."""
