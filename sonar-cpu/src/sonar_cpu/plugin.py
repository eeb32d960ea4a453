"""Registers the CPU platform with Sonar (entry point ``cpu`` in group ``sonar.plugins``)."""

from __future__ import annotations

from typing import Callable

from sonar.hookspecs import hookimpl

CPU_PLATFORM_PATH = "sonar_cpu.platform:CpuPlatform"


def detect_cpu() -> str | None:
    """A CPU is always present; the platform selector prefers any detected accelerator."""
    return CPU_PLATFORM_PATH


@hookimpl
def sonar_register_platforms(register: Callable[..., None]) -> None:
    register("cpu", detect_cpu)
