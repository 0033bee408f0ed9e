"""Tensor parallelism composed with data and pipeline parallelism over a DeviceMesh."""
