"""RL post-training on the elastic rollout: tasks with verifiable rewards (tasks.py), the GRPO
loss (loss.py), the training forward on the full ep mesh (actor.py), SFT warm start (sft.py) and
the GRPO loop (train.py)."""
