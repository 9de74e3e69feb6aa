"""optaxclip's benchmarks: run `python benchmarks/run.py`; see README.md."""
