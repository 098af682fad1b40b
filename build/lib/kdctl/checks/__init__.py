"""Checks: the readiness gates, each deciding pass, fail or inconclusive from measurements."""
