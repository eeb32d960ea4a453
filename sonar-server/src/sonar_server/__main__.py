"""``python -m sonar_server [MODEL] ...``: the same as ``sonar serve``."""

import argparse
import sys

from sonar_server.args import add_server_arguments
from sonar_server.launcher import serve


def main() -> int:
    parser = argparse.ArgumentParser(prog="sonar serve", description="Serve a model over HTTP.")
    add_server_arguments(parser)
    return serve(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
