"""Sonar CPU platform."""
