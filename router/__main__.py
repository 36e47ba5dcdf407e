"""`python -m router ...`: the same as `nanoserve router ...`."""

import sys

from router.cli import _standalone

sys.exit(_standalone())
