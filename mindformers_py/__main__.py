"""``python -m mindformers_py`` = the ``mindformers-py`` command."""

import sys

from .cli import main

sys.exit(main())
