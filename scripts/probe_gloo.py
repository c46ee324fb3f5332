"""Probe: do gloo CPU collectives run what the engine needs, across processes?

  python -m flexfloor_jax.launch --num_processes=2 --devices_per_process=4 -- \
      python scripts/probe_gloo.py
"""
from flexfloor_jax.runtime import distributed

distributed.initialize()
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils as mhu  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

pid = jax.process_index()
devs = jax.devices()
n = len(devs)
mesh = jax.make_mesh((n,), ("ep",), axis_types=(AxisType.Auto,), devices=devs)
sh = NamedSharding(mesh, P("ep"))
rep = NamedSharding(mesh, P())
results = {}


def check(name, fn):
  try:
    ok = fn()
    results[name] = "ok" if ok in (None, True) else f"MISMATCH {ok}"
  except Exception as e:  # noqa: BLE001
    results[name] = f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    traceback.print_exc()


host = np.arange(n * 4, dtype=np.int32).reshape(n, 4)


def t_device_put():
  x = jax.device_put(host, sh)
  return np.array_equal(mhu.process_allgather(x, tiled=True), host)


def t_callback():
  x = jax.make_array_from_callback(host.shape, sh, lambda i: host[i])
  return np.array_equal(mhu.process_allgather(x, tiled=True), host)


def t_single_device_arrays():
  bufs = [jax.device_put(host[i:i + 1], d) for i, d in enumerate(devs) if d.process_index == pid]
  x = jax.make_array_from_single_device_arrays(host.shape, sh, bufs)
  return np.array_equal(mhu.process_allgather(x, tiled=True), host)


def t_all_to_all():
  def f(x):  # x: [1, n*?]: send column j to worker j
    return jax.lax.all_to_all(x, "ep", 1, 1, tiled=True)
  data = np.arange(n * n, dtype=np.float32).reshape(n, n)
  x = jax.device_put(data, sh)
  y = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"),
                            check_vma=False))(x)
  return np.array_equal(mhu.process_allgather(y, tiled=True), data.T)


def t_psum_replicated_read():
  x = jax.device_put(np.ones((n,), np.int32), sh)
  y = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a.sum(), "ep"), mesh=mesh, in_specs=P("ep"),
                            out_specs=P(), check_vma=False))(x)
  return int(y) == n and np.asarray(y).item() == n


def t_np_asarray_sharded():
  x = jax.device_put(host, sh)
  np.asarray(x)  # expected to fail: not fully addressable


def t_device_put_jax_array_to_global():
  x = jnp.asarray(host)  # local, single device
  y = jax.device_put(x, rep)
  return np.array_equal(np.asarray(y.addressable_data(0)), host)


def t_device_put_cross_process():
  # a shard on process 0's device 0 -> process 1's first device (device_put between devices)
  sub = jax.sharding.SingleDeviceSharding(devs[0])
  src = jax.device_put(host[:1], devs[0]) if devs[0].process_index == pid else None
  if src is None:
    src = jax.make_array_from_single_device_arrays((1, 4), sub, [])
  y = jax.device_put(src, devs[-1])
  if devs[-1].process_index == pid:
    return np.array_equal(np.asarray(y), host[:1])


def t_reshard_jit_submesh():
  # array over devices 0..n-1 -> a replica on the sub-mesh of the last n/2 devices (other host)
  x = jax.device_put(host, sh)
  small = jax.make_mesh((n,), ("ep",), axis_types=(AxisType.Auto,),
                        devices=devs[::-1])  # permuted mesh over the same devices
  y = jax.jit(lambda a: a, out_shardings=NamedSharding(small, P("ep")))(x)
  return np.array_equal(mhu.process_allgather(y, tiled=True), host)


def t_device_put_reshard():
  x = jax.device_put(host, sh)
  small = jax.make_mesh((n,), ("ep",), axis_types=(AxisType.Auto,), devices=devs[::-1])
  y = jax.device_put(x, NamedSharding(small, P("ep")))
  return np.array_equal(mhu.process_allgather(y, tiled=True), host)


def t_kv_store():
  from jax._src import distributed as jd
  c = jd.global_state.client
  c.key_value_set(f"probe/{pid}", str(pid * 7))
  other = 1 - pid
  return c.blocking_key_value_get(f"probe/{other}", 20_000) == str(other * 7)


for name, fn in [("device_put(numpy, global sharding)", t_device_put),
                 ("make_array_from_callback", t_callback),
                 ("make_array_from_single_device_arrays", t_single_device_arrays),
                 ("all_to_all in shard_map (2 proc x 4 dev)", t_all_to_all),
                 ("psum -> replicated, int()/np.asarray on host", t_psum_replicated_read),
                 ("np.asarray(sharded non-addressable) [expected FAIL]", t_np_asarray_sharded),
                 ("device_put(local jax.Array, global replicated)", t_device_put_jax_array_to_global),
                 ("device_put single-device array to other process's device",
                  t_device_put_cross_process),
                 ("jit identity out_shardings=permuted mesh (cross-process reshard)",
                  t_reshard_jit_submesh),
                 ("device_put global array -> permuted-mesh sharding", t_device_put_reshard),
                 ("distributed KV store set/blocking_get", t_kv_store)]:
  check(name, fn)
mhu.sync_global_devices("probe_done")
for k, v in results.items():
  print(f"PROBE {k}: {v}", flush=True)
