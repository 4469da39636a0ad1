"""``python -m gradaudit``: the same program as the ``gradaudit`` command."""

from .cli import main

if __name__ == "__main__":
    main()
