"""Host-side rollout policy: numpy and stdlib only, never JAX.

workload    synthetic long-tailed response lengths (+ JSONL of lengths)
controller  the rollout control loop and the Executor protocol the engine implements
stepsim     a numpy Executor (step simulator) driven by the same controller
history     length history: response lengths by prompt and epoch, and its file
prediction  predicted lengths, length scenarios, prediction quality, from the history
scheduler   placements: static, balanced, FlexFloor (and the predict -> place pipeline)
floor       the fewest workers that hold the model, and the group sizes a release may leave
release_policy    release/compaction policy: when workers go and which sequences move
expert_placement  expert placement table (expert -> worker, slot) and how a release changes it
compile_plan  which mesh sizes (and which devices' movers) compile first: the plan's replay
accounting  timeline of a rollout -> the metrics of summary.json, timeline plot
drafts      speculative decoding's drafts: the response store and the suffix-matching drafter
speculation which drafted tokens a dispatch verifies, decided in seconds

The JAX engine and the cluster simulator both import this package, so what is simulated is what
runs. Importing it must not pull in jax (tests/test_layout.py checks that).
"""
