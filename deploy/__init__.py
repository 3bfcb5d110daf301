"""Deployment recipes for cpserve (not part of the installed package; run from the repo root)."""
