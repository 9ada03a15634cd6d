"""Stubs of the part of etcd's v3 gRPC API the etcd state backend uses, generated from proto/etcd/ (do not edit)."""
