"""Operators' control: the admin gRPC API (proto/extproc/admin/v1/admin.proto), its client
(``extproc admin``) and the read-only console on the metrics listener."""
