"""``python -m kvmove.cli``: the ``kvmove`` command."""

import sys

from kvmove.cli.command import main

sys.exit(main())
