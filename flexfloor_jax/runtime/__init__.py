"""Where the program runs: the process's JAX setup (backend), the `ep` mesh and its one table of
logical axes (mesh), multi-controller JAX (distributed) and the local multi-process launcher."""
