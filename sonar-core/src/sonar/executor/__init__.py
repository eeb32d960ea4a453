"""Executors: what runs the workers of one engine core."""

from sonar.executor.base import Executor, WorkerDiedError

__all__ = ["Executor", "WorkerDiedError"]
