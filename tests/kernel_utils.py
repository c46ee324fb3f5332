"""Shared numpy definitions for the kernel tests (CPU and GPU files)."""

import numpy as np


def combine_numpy(y, row_dst, w):
  """The combine's numerics in numpy: each fp32 product rounded, then added in k order."""
  acc = np.zeros((row_dst.shape[0], y.shape[1]), np.float32)
  for k in range(row_dst.shape[1]):
    valid = (row_dst[:, k] >= 0)[:, None]
    term = w[:, k, None].astype(np.float32) * y[np.maximum(row_dst[:, k], 0)].astype(np.float32)
    acc = acc + np.where(valid, term, np.float32(0))
  return acc
