"""Registers the ``dummy`` platform; its hardware is "present" when ``SONAR_DUMMY_PLATFORM=1``."""

from __future__ import annotations

import logging
import os
from typing import Callable

from sonar.hookspecs import hookimpl

logger = logging.getLogger(__name__)


def detect_dummy() -> str | None:
    if os.environ.get("SONAR_DUMMY_PLATFORM") != "1":
        logger.debug("dummy platform: SONAR_DUMMY_PLATFORM is not 1")
        return None
    return "sonar_dummy_platform.platform:DummyPlatform"


@hookimpl
def sonar_register_platforms(register: Callable[..., None]) -> None:
    register("dummy", detect_dummy)
