"""Reporters: pure functions from a Report to text (terminal, JSON, DOT/SVG, HTML)."""
