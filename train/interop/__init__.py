"""Weights (`weights`), runs and weights files (`runs`) and HF Marian models (`marian`) between formats, for
`--init-from` and `parity`; each module loads both frameworks, so none is imported until a conversion is asked for."""
