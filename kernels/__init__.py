"""Pallas Mosaic GPU kernels of jaxkv, one folder per op; imported as jaxkv.kernels."""
