"""``python -m sonar ...``: the ``sonar`` command (``python -m sonar serve MODEL``)."""

import sys

from sonar.cli.main import main

sys.exit(main())
