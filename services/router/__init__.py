"""The router: HTTP (OpenAI-compatible) and gRPC fronts, pairing, health, retries."""
