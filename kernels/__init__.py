"""MoE dispatch kernels over the padded tile layout: plan -> permute -> grouped_matmul -> combine.

Each kernel has a pure-XLA reference (`impl='xla'`, the CPU default) and a Pallas implementation of
the same signature (`impl='pallas'`: Mosaic TPU; on CUDA GPUs Mosaic GPU for the grouped matmul and
Pallas Triton for permute and combine; interpret mode on CPU via `interpret=True`). Both impls are
differentiable. `flexfloor_jax.model.config.resolve_moe_backend` maps `model.moe_backend` ('auto' |
'xla' | 'pallas') and the platform to `impl` / `interpret`.

`flexfloor_jax.kernels.paged_attention` (imported by its module path, not re-exported here) is the
decode attention over a paged KV pool: an XLA reference and adapters to JAX's Pallas TPU / GPU
kernels.
"""

from flexfloor_jax.kernels.combine import combine
from flexfloor_jax.kernels.dispatch_plan import DispatchPlan, make_plan, padded_rows
from flexfloor_jax.kernels.grouped_matmul import DEFAULT_TILE_M, grouped_matmul
from flexfloor_jax.kernels.permute import permute

__all__ = [
    "DEFAULT_TILE_M",
    "DispatchPlan",
    "combine",
    "grouped_matmul",
    "make_plan",
    "padded_rows",
    "permute",
]
