"""Live test and benchmark tooling: local fleets of simulated engines and gateways, processes
with readiness and clean stop, Prometheus scrapes, load generators. Never imported by the
gateway or the simulator (the layering contract in pyproject.toml checks it)."""
