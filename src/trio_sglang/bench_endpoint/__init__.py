"""``trio-sglang bench-endpoint``: the cancel latency of any serving endpoint, from its own metrics.

Clients leave a server in chosen ways (right after sending, before the first
token, at it, mid-stream; each with a clean close or a reset) while the
server's Prometheus gauges are sampled every few milliseconds. From them:
how long the server kept each request after its client left, how many
tokens it generated for nobody, and which requests it never let go.
docs/bench-endpoint.md has the method and what each server can show.

The modules are private; the command is the interface. ``_options`` needs
nothing beyond the package (the CLI builds its parser everywhere); the rest
needs the bench extra (httpx, matplotlib).
"""
