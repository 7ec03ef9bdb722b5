"""The decision server's parts, one responsibility per module; engine/server.py builds the model, binds the socket and
runs them (`python -m engine.server`).

`app` the ASGI app (routes, checks, the hand-off to the worker), `worker` the model worker thread and its bounded
queue, `admission` the cost bound of a request's largest forward, `protocol` uvicorn's httptools protocol with the
framing answers, `metrics` Prometheus text and CUDA memory, `access_log` the buffered access log.
"""
