"""Roadmaps (phases and their exit criteria) and prompt corpora, shipped as package data."""
