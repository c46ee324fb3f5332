"""Backends for other post-training frameworks (optional extras): `tunix` (google-tunix, the
`[tunix]` extra) plugs the elastic rollout into tunix's RLCluster."""
