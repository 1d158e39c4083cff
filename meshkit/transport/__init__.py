"""Ways ranks move bytes besides c10d's backends: `shared_memory`, the channel CPU ranks of one host
carry TP's and FSDP's collectives through."""
