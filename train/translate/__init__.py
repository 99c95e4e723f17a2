"""Translation as the commands do it: `jobs`, the input `stream`, its resumable `output`, `attention` heatmaps."""
