"""Executors: what runs the workers of one engine core."""

from sonar.executor.base import Executor

__all__ = ["Executor"]
