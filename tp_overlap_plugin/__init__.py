"""tp-overlap: overlapped tensor-parallel layers over a symmetric heap."""
