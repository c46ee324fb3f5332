"""Turn a GRPO run's length history into the simulator's `grpo_trace` workload.

  python -m flexfloor_jax.rl.sft --config=configs/grpo.py
  python -m flexfloor_jax.rl.train --config=configs/grpo.py
  python scripts/grpo_trace.py grpo_out flexfloor_jax/sim/traces/grpo_tiny.json

reads <run>/history.json (every step's response lengths, ended by EOS or the cap) and
<run>/prompts.jsonl (the prompts, tokenized as the rollout tokenizes them: the tiny preset's byte
tokenizer with BOS), and writes the trace (policy/workload.py, `load_trace`'s format).
"""

import json
import os
import sys
from typing import Any

from flexfloor_jax.config.files import load_config
from flexfloor_jax.io.atomic import atomic_write
from flexfloor_jax.io.jsonl import iter_jsonl
from flexfloor_jax.model.tokenizer import ByteTokenizer
from flexfloor_jax.policy import workload


def main(run_dir: str, out: str) -> None:
  with open(os.path.join(run_dir, "history.json")) as f:
    hist = json.load(f)
  tok = ByteTokenizer()
  prompt_len = {str(r["id"]): len(tok.encode(r["prompt"], add_bos=True))
                for _, r in iter_jsonl(os.path.join(run_dir, "prompts.jsonl"))}
  rollout: Any = load_config("grpo").rollout
  cap = int(rollout.max_new_tokens)  # the run's cap: configs/grpo.py's
  prompts = {}
  for pid, by_epoch in sorted(hist["prompts"].items()):
    epochs = [by_epoch[e] for e in sorted(by_epoch, key=int)]
    prompts[pid] = dict(prompt_len=prompt_len[pid], epochs=epochs)
  doc = dict(source=f"python -m flexfloor_jax.rl.train --config=configs/grpo.py after "
                    f"python -m flexfloor_jax.rl.sft --config=configs/grpo.py: {len(prompts)} "
                    f"prompts, every step's response lengths (EOS or the cap of {cap})",
             max_new_tokens=cap, prompts=prompts)
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  atomic_write(out, json.dumps(doc, indent=1))
  trace = workload.load_trace(out)  # the file reads back as the simulator will read it
  print(f"wrote {out}: {len(prompts)} prompts x {trace.samples_per_prompt} samples, "
        f"{trace.num_epochs} epochs, cap {cap}")


if __name__ == "__main__":
  if len(sys.argv) != 3:
    sys.exit("usage: python scripts/grpo_trace.py RUN_DIR OUT.json")
  main(sys.argv[1], sys.argv[2])
