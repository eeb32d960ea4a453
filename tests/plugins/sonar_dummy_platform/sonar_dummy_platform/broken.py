"""A plugin that fails to import (when ``SONAR_DUMMY_BROKEN=1``), as a plugin with a missing
dependency would. Sonar must log it, list it as failed and load the others."""

from __future__ import annotations

import os

if os.environ.get("SONAR_DUMMY_BROKEN") == "1":
    raise ImportError("sonar_dummy_platform.broken needs the 'dummy-driver' library, which is not installed")
