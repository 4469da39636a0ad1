"""The ``gradaudit`` command line."""

import sys


def main() -> None:
    sys.stderr.write("gradaudit: the command line is not built yet\n")
    sys.exit(2)
