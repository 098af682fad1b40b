"""kdctl: readiness gates, phases and gated cutover between LLM inference engines."""

__version__ = "0.1.0"
