"""Triton kernels (imported as tp_overlap_plugin.kernels)."""
