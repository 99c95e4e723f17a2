"""`python -m train.run`, as the quick start runs it: the command `train.commands.run` (`aiayn train`)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("train.commands.run", run_name="__main__", alter_sys=True)
