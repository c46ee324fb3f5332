"""The figure of a cluster simulation (sim.png): tokens per occupied device-second per schedule,
and FlexFloor over static, against the device count."""

from __future__ import annotations

from flexfloor_jax.io.atomic import atomic_open


def _atomic_savefig(fig, path: str):
  with atomic_open(path, "wb") as f:
    fig.savefig(f, format="png", dpi=110)


def plot_cluster(rows: list[dict], path: str) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  xs = [r["devices"] for r in rows]
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
  a.plot(xs, [r["static"]["tokens_per_occupied_device_second"] for r in rows], "o-",
         label="static")
  a.plot(xs, [r["flexfloor"]["tokens_per_occupied_device_second"] for r in rows], "s-",
         label="flexfloor")
  a.set_xscale("log", base=2)
  a.set_xlabel("devices")
  a.set_ylabel("tokens / occupied device-second")
  a.legend()
  b.plot(xs, [r["ratio"]["tokens_per_occupied_device_second"] for r in rows], "o-",
         label="tokens / occupied device-s")
  b.plot(xs, [r["ratio"]["throughput_tokens_per_s"] for r in rows], "s--", label="throughput")
  b.axhline(1.654, color="gray", ls=":", label="paper 1.654")
  b.set_xscale("log", base=2)
  b.set_xlabel("devices")
  b.set_ylabel("flexfloor / static")
  b.legend(fontsize=8)
  r0 = rows[0]
  fig.suptitle(f"{r0['model']} on {r0['hardware']} (ep={r0['ep']}, floor {r0['floor']}, "
               f"epoch {r0['epoch']})")
  fig.tight_layout()
  try:
    _atomic_savefig(fig, path)
  finally:
    plt.close(fig)
  return path

