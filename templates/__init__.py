"""jinja2 templates for reports and router configuration, shipped as package data."""
