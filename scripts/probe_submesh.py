"""Probe: a process with no device in the mesh calling the same compiled step (no-op?)."""
from flexfloor_jax.runtime import distributed

distributed.initialize()
import jax  # noqa: E401,E402
import numpy as np
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

pid = jax.process_index()
devs = jax.devices()
sub = jax.make_mesh((4,), ("ep",), axis_types=(AxisType.Auto,), devices=devs[4:])
sh = NamedSharding(sub, P("ep"))
host = np.arange(16, dtype=np.float32).reshape(4, 4)
try:
  x = jax.device_put(host, sh)
  print("PROBE2 device_put onto mesh without local devices: ok, shards", len(x.addressable_shards), flush=True)
  f = jax.jit(jax.shard_map(lambda a: jax.lax.all_to_all(a, "ep", 1, 1, tiled=True), mesh=sub,
                            in_specs=P("ep"), out_specs=P("ep"), check_vma=False))
  c = f.lower(jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=sh)).compile()
  y = c(x)
  jax.block_until_ready(y)
  print("PROBE2 compiled call with no local devices: ok, shards", len(y.addressable_shards), flush=True)
  bufs = [s.data for s in y.addressable_shards]
  z = jax.make_array_from_single_device_arrays(y.shape, sh, bufs, dtype=y.dtype)
  print("PROBE2 make_array_from_single_device_arrays([] , dtype): ok", flush=True)
except Exception as e:  # noqa: BLE001
  print("PROBE2 FAIL", type(e).__name__, str(e)[:300], flush=True)
