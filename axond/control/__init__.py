"""Client side of the control plane: the coordinator client and its KV store."""
