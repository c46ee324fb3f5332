"""CI runs both notebooks headless (nbclient) on CPU with FLEXFLOOR_SMOKE=1; any failing cell
fails."""

import os
import re
import sys

import checkout
import pytest
from checkout import ROOT

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

CELL_TIMEOUT_S = 300


def _execute(name: str, out_dir: str):
  path = os.path.join(ROOT, "colab", name)
  nb = nbformat.read(path, as_version=4)
  assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
      f"{name} must be saved without outputs")
  # the suite's compilation cache and XLA flags; the notebook sets up its own emulated devices
  env = checkout.child_env(FLEXFLOOR_SMOKE="1", FLEXFLOOR_OUT=out_dir)
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
  # 'python3' is the kernelspec ipykernel installs into this interpreter's sys.prefix;
  # jupyter_client runs it with sys.executable.
  client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                   resources={"metadata": {"path": str(ROOT)}})
  client.execute(cwd=ROOT, env=env)  # raises CellExecutionError on the first failing cell
  return nb


def _text(nb) -> str:
  parts = []
  for c in nb.cells:
    for o in c.get("outputs", []):
      if o.output_type == "stream":
        parts.append(o.text)
      elif "data" in o:
        parts.append(o.data.get("text/markdown", "") or o.data.get("text/plain", ""))
  text = "\n".join(parts)
  print(text)  # shown by pytest on failure (or with -rP)
  return text


@pytest.mark.slow
def test_quickstart_notebook(tmp_path):
  nb = _execute("quickstart.ipynb", str(tmp_path))
  text = _text(nb)
  pngs = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
  assert len(pngs) == 2, "one timeline plot per schedule"
  row = re.search(r"\| tokens_per_device_step \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", text)
  assert row, text
  static, flex, ratio = map(float, row.groups())
  assert flex > static and ratio > 1.0
  idle = re.search(r"\| idle_after_finish_fraction \| ([\d.]+) \| ([\d.]+) \|", text)
  assert idle and float(idle.group(2)) < float(idle.group(1))
  assert os.path.isfile(tmp_path / "flexfloor" / "timeline.png")


@pytest.mark.slow
def test_tpu_pod_notebook_smoke(tmp_path):
  nb = _execute("tpu_pod_mixtral.ipynb", str(tmp_path))
  text = _text(nb)
  assert "on_tpu=False" in text and "smoke=True" in text
  assert re.search(r"flexfloor: \d+ responses", text), text
  assert os.path.isfile(tmp_path / "rollout" / "summary.json")
  assert "GRPO skipped" in text or (tmp_path / "grpo").is_dir()
