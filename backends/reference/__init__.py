"""The reference backend: a Hugging Face model in-process (needs the `reference` extra)."""
