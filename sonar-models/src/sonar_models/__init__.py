"""Sonar model architectures and weight formats."""
