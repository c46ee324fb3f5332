"""Measured step tables (sim/measured_hw.py, scripts/device_check.sh's output) as a simulator
hardware preset: parsing, validation errors, interpolation against hand-computed values, the
sim's decode cost on a table, and `python -m flexfloor_jax.sim --hardware=measured:FILE`.
numpy only: the table is made here, no accelerator needed."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
from checkout import ROOT

from flexfloor_jax.sim import costs, measured_hw, presets

MIXTRAL = dict(hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, experts=8, top_k=2,
               vocab=32000)
E_GRID, B_GRID, KV_GRID = (1, 2, 8), (8, 32), (1024, 4096)


def f(e, b, kv):
  """Seconds per layer of the test table: multilinear, so trilinear interpolation is exact."""
  return 1e-4 * (1 + 0.5 * e) * (1 + b / 32) * (1 + kv / 4096)


def make_table(**over):
  t = dict(format="flexfloor_jax.step_table", version=1, device="Test GPU", platform="gpu",
           jax_version="0", created="2026-12-04T00:00:00Z", dtype="bfloat16", model=dict(MIXTRAL),
           layers_timed=2, sim_base_preset="h200", measured=dict(hbm_bw=4.0e12, peak_flops=7.0e14),
           engine=dict(moe_backend="xla", decode_tile_m=8, chunk_tokens=64),
           fixed=[dict(batch=8, seconds=1e-4), dict(batch=32, seconds=3e-4)],
           rows=[dict(experts_per_device=e, batch=b, kv_len=k, seconds_per_layer=f(e, b, k),
                      step_seconds=2 * f(e, b, k))
                 for e in E_GRID for b in B_GRID for k in KV_GRID])
  t.update(over)
  return t


def write(tmp_path, obj, name="table.json"):
  p = tmp_path / name
  p.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
  return str(p)


def test_parse_and_interpolate_by_hand(tmp_path):
  tab = measured_hw.load(write(tmp_path, make_table()))
  np.testing.assert_array_equal(tab.experts, E_GRID)
  np.testing.assert_array_equal(tab.batches, B_GRID)
  np.testing.assert_array_equal(tab.kv_lens, KV_GRID)
  assert tab.layers_timed == 2 and tab.model["vocab"] == 32000
  # grid points are returned exactly
  for e in E_GRID:
    for b in B_GRID:
      for k in KV_GRID:
        assert tab.seconds_per_layer(e, b, k) == pytest.approx(f(e, b, k), rel=1e-12)
  # inside the grid: e=4 between 2 and 8 (weight 1/3), b=20 (weight 1/2), kv=2560 (weight 1/2):
  # f is multilinear, so interpolation gives f itself; by hand:
  # (1 + 0.5*4) = 3, (1 + 20/32) = 1.625, (1 + 2560/4096) = 1.625 -> 1e-4 * 3 * 1.625 * 1.625
  assert tab.seconds_per_layer(4, 20, 2560) == pytest.approx(1e-4 * 3 * 1.625 * 1.625, rel=1e-12)
  # batch above the grid continues the last segment; below it is clamped
  assert tab.seconds_per_layer(2, 64, 1024) == pytest.approx(f(2, 64, 1024), rel=1e-12)
  assert tab.seconds_per_layer(2, 1, 1024) == pytest.approx(f(2, 8, 1024), rel=1e-12)
  # kv extends both ways (linear), never below 0 cached tokens
  assert tab.seconds_per_layer(1, 8, 512) == pytest.approx(f(1, 8, 512), rel=1e-12)
  assert tab.seconds_per_layer(1, 8, 8192) == pytest.approx(f(1, 8, 8192), rel=1e-12)
  assert tab.seconds_per_layer(1, 8, -5) == pytest.approx(f(1, 8, 0), rel=1e-12)
  # experts are clamped to the measured range
  assert tab.seconds_per_layer(0, 8, 1024) == pytest.approx(f(1, 8, 1024), rel=1e-12)
  # vectorised
  got = tab.seconds_per_layer(np.array([1, 8]), np.array([8, 32]), 1024)
  np.testing.assert_allclose(got, [f(1, 8, 1024), f(8, 32, 1024)], rtol=1e-12)
  # the fixed part: linear in batch, clamped below, extended above
  assert tab.fixed_seconds(20) == pytest.approx(2e-4)
  assert tab.fixed_seconds(4) == pytest.approx(1e-4)
  assert tab.fixed_seconds(56) == pytest.approx(5e-4)
  assert tab.headline(32, 1024) == pytest.approx({e: f(e, 32, 1024) for e in E_GRID})


def test_worker_seconds_scales_layers_and_vocab(tmp_path):
  tab = measured_hw.load(write(tmp_path, make_table()))
  m = dataclasses.replace(presets.MODELS["mixtral-8x7b"], vocab=64000)  # lm_head twice the table's
  held, tok, ctx = np.array([2.0, 8.0]), np.array([20.0, 8.0]), np.array([20 * 2560, 8 * 1024])
  got = tab.worker_seconds(m, held, tok, ctx)
  want = [32 * 1e-4 * 2 * 1.625 * 1.625 + 2 * 2e-4, 32 * f(8, 8, 1024) + 2 * 1e-4]
  np.testing.assert_allclose(got, want, rtol=1e-12)
  # a worker with no live sequence still serves its experts: the smallest batch's time
  z = tab.worker_seconds(m, np.array([8.0]), np.array([0.0]), np.array([0.0]))
  assert z[0] == pytest.approx(32 * f(8, 8, 1024) + 2 * 1e-4)


def test_sim_decode_cost_uses_the_table_prefill_the_roofline(tmp_path):
  model = presets.MODELS["mixtral-8x7b"]
  hw = measured_hw.load_hardware(write(tmp_path, make_table()), presets.HARDWARE, model)
  base = presets.HARDWARE["h200"]
  assert hw.name == "measured:table.json" and hw.link_bw == base.link_bw
  assert hw.hbm_bytes == base.hbm_bytes and hw.hbm_bw == 4.0e12 and hw.peak_flops == 7.0e14
  assert "Test GPU" in hw.source
  held, tok, ctx = np.array([2.0, 2.0, 2.0, 2.0]), np.full(4, 32.0), np.full(4, 32.0 * 1024)
  cost = costs.RooflineCost(model, hw)
  # all_to_all by hand: each worker sends 3/4 of dispatch + combine of 32 tokens x top-2 x 4096
  # x 2 bytes in 32 layers, 25,165,824 bytes at h200's 450 GB/s, + 64 collectives x 5 us
  a2a = 25_165_824 / 450e9 + 64 * 5e-6
  want = hw.step_overhead_s + 32 * f(2, 32, 1024) + 3e-4 + a2a
  assert cost.step_seconds(held, tok, ctx) == pytest.approx(want, rel=1e-12)
  # one worker: no all_to_all
  assert cost.step_seconds(np.array([8.0]), np.array([8.0]), np.array([8 * 4096.0])) == \
      pytest.approx(hw.step_overhead_s + 32 * f(8, 8, 4096) + 1e-4, rel=1e-12)
  # prefill (attn_ctx given) stays on the roofline of the measured bandwidth / FLOP/s
  pre = cost.step_seconds(held, tok, tok, tok * tok / 2)
  roof = costs.RooflineCost(model, dataclasses.replace(hw, step_table=None))
  assert pre == roof.step_seconds(held, tok, tok, tok * tok / 2)
  # the policy's StepCost goes through the same decode cost
  sc = costs.RooflineStepCost(model, hw, 1024.0)
  assert sc.decode_seconds(4, 128) == pytest.approx(want, rel=1e-12)
  # the other presets are untouched
  assert presets.HARDWARE["h200"].step_table is None


@pytest.mark.parametrize("mutate,field", [
    (lambda t: t.update(format="other"), "format"),
    (lambda t: t.update(version=2), "version"),
    (lambda t: t.pop("model"), "model"),
    (lambda t: t["model"].update(hidden=0), "model.hidden"),
    (lambda t: t["model"].update(top_k=9), "model.top_k"),
    (lambda t: t.update(layers_timed="4"), "layers_timed"),
    (lambda t: t.update(sim_base_preset=None), "sim_base_preset"),
    (lambda t: t["measured"].update(hbm_bw=-1), "measured.hbm_bw"),
    (lambda t: t.update(rows=[]), "rows"),
    (lambda t: t["rows"][3].update(seconds_per_layer=float("nan")), "rows[3].seconds_per_layer"),
    (lambda t: t["rows"][3].update(seconds_per_layer=0), "rows[3].seconds_per_layer"),
    (lambda t: t["rows"][5].pop("kv_len"), "rows[5].kv_len"),
    (lambda t: t["rows"][5].update(batch=8.5), "rows[5].batch"),
    (lambda t: t["rows"][0].update(experts_per_device=16), "rows[0].experts_per_device"),
    (lambda t: t["rows"].pop(4), "rows"),  # a hole in the grid
    (lambda t: t["rows"].append(dict(t["rows"][0])), "rows[12]"),  # duplicate point
    (lambda t: t["fixed"][1].update(seconds=-1.0), "fixed[1].seconds"),
    (lambda t: t["fixed"].append(dict(batch=8, seconds=1.0)), "fixed[2].batch"),
])
def test_validation_errors_name_file_and_field(tmp_path, mutate, field):
  t = copy.deepcopy(make_table())
  mutate(t)
  path = write(tmp_path, t)
  with pytest.raises(measured_hw.TableError) as ei:
    measured_hw.load(path)
  msg = str(ei.value)
  assert msg.startswith(f"{path}: {field}:"), msg


def test_unreadable_and_mismatched_tables(tmp_path):
  with pytest.raises(measured_hw.TableError, match="cannot read"):
    measured_hw.load(str(tmp_path / "nope.json"))
  with pytest.raises(measured_hw.TableError, match="not JSON"):
    measured_hw.load(write(tmp_path, "{rows: 1"))
  with pytest.raises(measured_hw.TableError, match="full grid.*missing"):
    t = make_table()
    t["rows"] = [r for r in t["rows"] if not (r["experts_per_device"] == 8 and r["batch"] == 32)]
    measured_hw.load(write(tmp_path, t))
  path = write(tmp_path, make_table(sim_base_preset="gpu-9000"))
  with pytest.raises(measured_hw.TableError, match="sim_base_preset.*gpu-9000"):
    measured_hw.load_hardware(path, presets.HARDWARE)
  path = write(tmp_path, make_table())
  # a table measured on another layer shape: the sim CLI (`--hardware=measured:FILE`) prints a
  # ValueError of load_hardware as its one `error: --hardware: ...` line and exits 2
  assert issubclass(measured_hw.TableError, ValueError)
  with pytest.raises(measured_hw.TableError, match=r"model: .*hidden 6144 \(table 4096\)") as e:
    measured_hw.load_hardware(path, presets.HARDWARE, presets.MODELS["mixtral-8x22b"])
  assert "\n" not in str(e.value)
  with pytest.raises(measured_hw.TableError, match="dtype_bytes 4"):
    measured_hw.load_hardware(path, presets.HARDWARE, dataclasses.replace(
        presets.MODELS["mixtral-8x7b"], dtype_bytes=4))


def test_sim_cli_on_a_measured_table(tmp_path):
  path = write(tmp_path, make_table(), "h.json")
  out = tmp_path / "out"
  r = subprocess.run([sys.executable, "-m", "flexfloor_jax.sim", "--model=mixtral-8x7b",
                      f"--hardware=measured:{path}", "--devices=8", "--length_scale=1",
                      f"--output_dir={out}"], cwd=ROOT, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stdout + r.stderr
  assert "decode steps measured on Test GPU" in r.stdout
  (row,) = json.loads((out / "sim.json").read_text())
  assert row["hardware"] == "measured:h.json" and row["devices"] == 8
  for k in ("static", "balanced", "flexfloor"):
    assert row[k]["generation_wall_s"] > 0 and row[k]["tokens_per_occupied_device_second"] > 0
