"""slogate: SLO-aware OpenAI-compatible gateway."""

__version__ = "0.1.0"
