"""Backends of the h2o ops: reference.py is the executable spec; Triton kernels for CUDA."""
