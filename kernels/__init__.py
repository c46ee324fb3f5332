"""MoE dispatch kernels over the padded tile layout: plan -> permute -> grouped_matmul -> combine.

Each kernel has a pure-XLA reference (`impl='xla'`, the CPU default and the training path) and a
Pallas implementation of the same signature (`impl='pallas'`: Mosaic TPU, Mosaic GPU for the grouped
matmul, interpret mode on CPU via `interpret=True`).
"""

from kernels.combine import combine
from kernels.dispatch_plan import DispatchPlan, make_plan, padded_rows
from kernels.grouped_matmul import DEFAULT_TILE_M, grouped_matmul
from kernels.permute import permute

__all__ = [
    "DEFAULT_TILE_M",
    "DispatchPlan",
    "combine",
    "grouped_matmul",
    "make_plan",
    "padded_rows",
    "permute",
]
