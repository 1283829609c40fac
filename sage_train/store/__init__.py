"""What a run keeps on disk: the run directory, its reports, checkpoints and figures."""
