"""Reporters: pure functions from a Report (or a checkpoint Plan) to text (terminal, JSON, DOT/SVG, HTML)."""
