"""The decision server's parts, one responsibility per module (engine/server.py runs them)."""
