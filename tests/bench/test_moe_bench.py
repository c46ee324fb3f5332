"""`python -m flexfloor_jax.bench.moe` at Qwen3-MoE's routing (128 experts, top-8), tiny width:
every variant runs and equals the layer bit for bit, the tile follows the rows per expert slot,
and a capacity bucket below the exact capacity holds the largest (source, destination) count."""

import jax
import pytest

from flexfloor_jax.bench import moe as moe_bench
from flexfloor_jax.model.moe import exchange_capacities


def test_moe_bench_runs_every_variant_at_128_experts():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  r = moe_bench.run(n=8, t=16, d=16, f=8, e=128, k=8, runs=1)
  tm = r["timings"]
  assert set(tm) == {"layer", "exact", "ragged", "dense", "per_expert"}
  assert tm["exact"].bitwise_equal and tm["ragged"].bitwise_equal
  assert all(x.wall_s > 0 and x.cpu_s >= 0 for x in tm.values())
  assert r["slots"] == 16 and r["tile_m"] == 8  # 16 * 8 / 16 = 8 rows per slot
  assert r["sent"].sum() == 8 * 16 * 8 and r["counts"].sum() == 8 * 16 * 8
  caps = exchange_capacities(16 * 8, 8, r["factors"])  # a bucket below the exact capacity
  assert min(c for c in caps if c >= r["sent"].max()) < 16 * 8, (caps, r["sent"].max())
