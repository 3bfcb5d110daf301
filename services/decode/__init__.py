"""The decode gRPC service (services/decode/server.py)."""
