"""`train.fit` trains a run, `train.load` opens one (docs/python.md); `train.options`: the options they take."""

from . import options
from .api import Run, load
from .training import fit

__all__ = ["Run", "fit", "load", "options"]
