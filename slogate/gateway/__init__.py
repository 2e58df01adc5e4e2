"""The live async gateway (FastAPI), built on `router/` and `predictors/` — see its issue."""
