"""Sonar's HTTP server: ``sonar serve``. Each API surface (OpenAI, Anthropic, KoboldAI,
operations) is a plugin registered through ``sonar_register_api_surfaces``."""

__version__ = "0.1.0"
