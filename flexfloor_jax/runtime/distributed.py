"""Multi-controller JAX: `jax.distributed.initialize` from flags or the environment.

Sources, first match wins:
- explicit arguments (the CLI flags --coordinator_address, --num_processes, --process_id);
- FLEXFLOOR_COORDINATOR / FLEXFLOOR_NUM_PROCESSES / FLEXFLOOR_PROCESS_ID (set by
  `python -m flexfloor_jax.launch`);
- nothing given and a cluster JAX detects (TPU pod, SLURM, ...): `initialize()` with no arguments
  (only when FLEXFLOOR_DISTRIBUTED=1 or a SLURM/TPU-pod environment is seen).
On CPU the cross-process collectives are gloo (`jax_cpu_collectives_implementation`), set before
initialize. Single process (nothing configured): a no-op.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import io
import os
import signal
import threading

import jax
import numpy as np
from absl import flags
from jax._src import distributed as jd

from flexfloor_jax.runtime import interrupt
from flexfloor_jax.runtime import mesh as mesh_lib

ENV_COORD = "FLEXFLOOR_COORDINATOR"
ENV_NPROC = "FLEXFLOOR_NUM_PROCESSES"
ENV_PID = "FLEXFLOOR_PROCESS_ID"
ENV_DEVICES = "FLEXFLOOR_DEVICES_PER_PROCESS"  # emulated CPU devices per process (launch.py)

_initialized = False


def local_cpu_devices() -> int | None:
  v = os.environ.get(ENV_DEVICES)
  return int(v) if v else None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
  """Start jax.distributed if configured; returns True when running multi-process."""
  global _initialized
  if _initialized:
    return True
  coordinator_address = coordinator_address or os.environ.get(ENV_COORD) or None
  if num_processes is None and os.environ.get(ENV_NPROC):
    num_processes = int(os.environ[ENV_NPROC])
  if process_id is None and os.environ.get(ENV_PID):
    process_id = int(os.environ[ENV_PID])
  auto = os.environ.get("FLEXFLOOR_DISTRIBUTED") == "1"
  if coordinator_address is None and not auto:
    return False
  if _on_cpu():
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # jax.distributed installs a SIGTERM handler of its own (a preemption notice for its sync
  # points, which this package does not use): the entry point's handler, which ends the run with
  # its cleanup, is put back.
  on_term = signal.getsignal(signal.SIGTERM)
  if coordinator_address is None:  # TPU pod / SLURM: JAX detects the cluster
    jax.distributed.initialize()
  else:
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
  if callable(on_term):
    signal.signal(signal.SIGTERM, on_term)
  _initialized = True
  interrupt.at_exit(_leave)
  interrupt.note(_writes_nothing)
  return True


# An interrupted process leaves the job in step with the others. A process that just exits makes
# the others' coordination clients see their service, or a peer, vanish: they abort with a C++
# stack dump ("Fatal Python error: Aborted"), and a peer's collective fails with a traceback.
# jax.distributed.shutdown is a barrier of every process before each disconnects, so the
# processes a launcher stopped together leave together. It waits at most LEAVE_S: the longest a
# stopped peer takes to get there (its watchdog, interrupt.UNWIND_S after the signal), plus
# margin. A process whose peers were not told to stop leaves alone after that.
LEAVE_S = interrupt.UNWIND_S + 3.0


def _leave() -> None:
  def shutdown():
    with contextlib.suppress(Exception):
      jax.distributed.shutdown()
  t = threading.Thread(target=shutdown, daemon=True, name="leave")
  t.start()
  t.join(LEAVE_S)


def _writes_nothing() -> str | None:
  # the coordination service's ids: asking jax.process_index() could start the backend here
  k, n = jd.global_state.process_id, jd.global_state.num_processes
  return f"process {k} of {n} writes no outputs" if k else None


def _on_cpu() -> bool:
  plats = os.environ.get("JAX_PLATFORMS", "") or os.environ.get("JAX_PLATFORM_NAME", "")
  if plats:
    return plats.split(",")[0].strip() == "cpu"
  try:  # no accelerator plugin installed: CPU
    return not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin",
                                                        "libtpu", "jax_rocm60_plugin"))
  except Exception:
    return True


# ----------------------------------------------------------------------------- barriers

# How long a process waits at a barrier for the others. Generous on purpose: the processes
# compile the same executables in different times (another job on the host, a colder compile
# cache), and the wait before a new mesh's first collective must absorb all of that.
SYNC_TIMEOUT_S = float(os.environ.get("FLEXFLOOR_SYNC_TIMEOUT_S", "1800"))
_sync_counter = 0


def sync(tag: str, timeout_s: float | None = None) -> None:
  """Every process reaches this point before any goes on (multi-process; else a no-op).

  Called before the first collective of each newly compiled executable. Gloo builds a
  communicator at the first collective over a set of devices, and waits for the other processes'
  keys there with a short timeout of its own, not configurable from JAX: a process that got
  there a compile earlier would fail with `GetKeyValue() timed out`. This barrier, in the
  coordination service, waits `timeout_s` instead. `tag` names the point in a timeout error, and
  differing tags (processes out of step) time out rather than pair up wrongly. Every process must
  call this in the same order."""
  if jax.process_count() == 1:
    return
  global _sync_counter
  _sync_counter += 1
  timeout = SYNC_TIMEOUT_S if timeout_s is None else timeout_s
  _kv_client().wait_at_barrier(f"flexfloor/sync/{_sync_counter}/{tag}", int(timeout * 1000))


# ----------------------------------------------------------------------------- host reads

_read_counter = 0
_gather_fns: dict = {}


def _identity(*a):
  return a


def host_values(arrays):
  """The full host value of each (possibly sharded, possibly non-addressable) jax.Array, equal
  on every process. Single process: np.asarray. Multi-process: one jitted identity gathers the
  arrays to replicated over their mesh (a no-op on processes without a device in it); the lowest
  process of the mesh publishes the values through the distributed key-value store to the
  processes outside the mesh (their workers were all released), which read them from there.
  Every process must call this in the same order (the control loop runs in lockstep)."""
  arrays = list(arrays)
  if jax.process_count() == 1:
    return [np.asarray(a) for a in arrays]
  global _read_counter
  _read_counter += 1
  key = f"flexfloor/host/{_read_counter}"
  mesh = arrays[0].sharding.mesh
  ck = (mesh, tuple((a.shape, a.dtype, a.sharding) for a in arrays))
  if ck not in _gather_fns:
    rep = mesh_lib.replicated(mesh)
    _gather_fns[ck] = jax.jit(_identity, out_shardings=tuple(rep for _ in arrays)).lower(
        *arrays).compile()
    sync(f"gather/{mesh.size}")  # first all-gather on this mesh: every process compiled it
  gathered = _gather_fns[ck](*arrays)
  pid = jax.process_index()
  inside = sorted({d.process_index for d in mesh.devices.reshape(-1)})
  client = _kv_client()
  if pid in inside:
    out = [np.asarray(g.addressable_data(0)) for g in gathered]
    if pid == inside[0] and len(inside) < jax.process_count():
      client.key_value_set(key, _encode(out))
    return out
  return _decode(client.blocking_key_value_get(key, 600_000))


def _kv_client():
  client = jd.global_state.client
  assert client is not None  # multi-process: jax.distributed.initialize started it
  return client


def _encode(values) -> str:
  buf = io.BytesIO()
  np.savez(buf, *values)
  return base64.b64encode(buf.getvalue()).decode("ascii")


def _decode(s: str):
  with np.load(io.BytesIO(base64.b64decode(s))) as z:
    return [z[f"arr_{i}"] for i in range(len(z.files))]


def define_flags():
  """--coordinator_address / --num_processes / --process_id for a CLI (absl)."""
  return (flags.DEFINE_string("coordinator_address", None, "jax.distributed coordinator host:port "
                              "(default: $FLEXFLOOR_COORDINATOR; TPU pods/SLURM: detected)."),
          flags.DEFINE_integer("num_processes", None, "Processes in the job."),
          flags.DEFINE_integer("process_id", None, "This process's index."))


def initialize_from_flags(defined) -> bool:
  coord, nproc, pid = defined
  return initialize(coord.value, nproc.value, pid.value)
