"""``python -m kvmove.tuning``: the same as ``kvmove tune``."""

import logging
import sys

from kvmove.tuning.command import tune_main

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
sys.exit(tune_main())
