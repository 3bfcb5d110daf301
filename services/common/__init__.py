"""Pieces shared by the prefill and decode services: config models, gRPC helpers, conversions."""
