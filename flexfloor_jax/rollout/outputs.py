"""A rollout's outputs: responses.jsonl, summary.json, timeline.png and the length history, checked
(finite log-probs) and published as one set (io/output_dir.py), or one OutputError naming the
file."""

from __future__ import annotations

import contextlib
import json
import math
import os

from flexfloor_jax.io import output_dir
from flexfloor_jax.policy import accounting
from flexfloor_jax.policy.accounting import jsonable
from flexfloor_jax.policy.history import HistoryError, LengthHistory, lock_history
from flexfloor_jax.rollout.inputs import ROLLOUT_OUTPUTS, RolloutError


class OutputError(RolloutError):
  """The outputs could not be written (disk full, read-only, ...): the message names the file.
  `result`: the finished rollout (its responses are not lost); `staging`: the directory that
  keeps the files written before the failure (None when nothing could be kept)."""

  def __init__(self, msg: str, result=None, staging=None):
    super().__init__(msg)
    self.result, self.staging = result, staging


def check_finite_logprobs(responses: list[dict], epoch: int) -> None:
  """NaN or inf log-probs (weights or activations out of range for model.dtype) are garbage to
  any consumer and invalid JSON in responses.jsonl: stop naming the first response, as the
  trainer and the weight loader do for theirs."""
  bad = [x for x in responses if not all(math.isfinite(v) for v in x["logprobs"])]
  if bad:
    raise RolloutError(f"epoch {epoch}: a log-prob of prompt {bad[0]['prompt_id']!r} sample "
                       f"{bad[0]['sample']} is not finite ({len(bad)} response(s) in all): the "
                       "model computed NaN or inf (check the weights and model.dtype); nothing "
                       "was written")


def publish_outputs(out: str, responses: list[dict], summary: dict, timeline, title: str,
                    history: LengthHistory, history_path: str) -> str:
  """responses.jsonl (first: it survives a later failure), summary.json (with the set's run_id),
  timeline.png and, when it lives in `out`, history.json, published as one set; returns the
  set's directory. Raises output_dir.OutputWriteError naming the file. A history file elsewhere
  (scheduler.history_path) is replaced on its own after the set is published. Either way the
  history file's own lock is held from its merge to its replacement: another run may keep the
  same file from another output directory. Interrupted (Ctrl-C) before the publish, the staged
  set is discarded and the previous one stays."""
  in_set = os.path.abspath(history_path) == os.path.abspath(os.path.join(out, "history.json"))
  if in_set:
    try:
      hold = lock_history(history_path)
    except HistoryError as e:
      raise output_dir.OutputWriteError(
          f"scheduler.history_path: {e}; nothing was published") from None
  else:
    hold = contextlib.nullcontext()
  with hold, output_dir.OutputSet(out, "rollout.output_dir", owns=ROLLOUT_OUTPUTS,
                                  adopt=("history.json",) if in_set else ()) as s:
    s.write("responses.jsonl",
            "".join(json.dumps(jsonable(x), allow_nan=False) + "\n" for x in responses))
    s.write("summary.json", json.dumps(dict(jsonable(summary, nonfinite_to_none=True),
                                            run_id=s.run_id), indent=2, allow_nan=False))
    with s.writing("timeline.png") as path:
      accounting.plot_timeline(timeline, path, title=title)
    if in_set:  # merged with the published one
      with s.writing("history.json") as path:
        try:
          history.save(path, current=history_path)
        except HistoryError as e:
          raise output_dir.OutputWriteError(
              f"scheduler.history_path: {e}; nothing was published (the files written so far "
              f"are kept in {s.staging})", s.staging, tuple(s.written)) from None
    final = s.publish()
  if not in_set:  # merged with the file as it is now, under the file's own lock
    try:
      history.save(history_path)
    except (OSError, HistoryError) as e:
      why = output_dir.os_error_text(e) if isinstance(e, OSError) else str(e)
      raise output_dir.OutputWriteError(
          f"scheduler.history_path: writing {history_path} failed: {why} (the outputs were "
          f"published in {final})", final, tuple(s.written)) from None
  return final
