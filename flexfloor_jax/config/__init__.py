"""From config files to typed settings: the config files of configs/ loaded by name (files), the
--config flag of every entry point (cli), one section's fields read with field-named errors
(reader), the frozen settings (settings). No JAX."""
