#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the demo on an embedded Mooncake master.
# Extra arguments go to `kvmove demo` (see `.venv/bin/kvmove demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvmove demo "$@"
