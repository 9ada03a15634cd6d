"""Generated gRPC stubs of proto/axond/v1 (do not edit; regenerate, see README)."""
