"""Weights as the file stores them, and the linear kernels that compute on them."""
