"""Translation as the commands do it: the jobs of `aiayn translate`, `evaluate` and `score` (`jobs`), the
stream of input lines (`stream`), its resumable output and progress line (`output`), attention heatmaps
(`attention`); over `train.load`'s `Run`."""
