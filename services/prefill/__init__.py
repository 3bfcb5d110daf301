"""The prefill gRPC service (services/prefill/server.py)."""
