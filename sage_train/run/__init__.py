"""One training run: its settings, their resolution, the steps, the loop, resume, export."""
