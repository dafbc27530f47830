"""`python -m draftopd.cli`: the same as the `draftopd` command."""

import sys

from draftopd.cli import main

sys.exit(main())
