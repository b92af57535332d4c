# Sourced by the set-up and test scripts: say, die, and quietly (a step's output goes to a
# log file; the terminal sees one line, or the log's tail and path when the step fails).
# The caller sets TAG (the script's name in messages) and may set SETUP_LOG.
say() { printf '\033[1m[%s]\033[0m %s\n' "${TAG:-kvmove}" "$*"; }
die() { printf '\033[1;31m[%s] error:\033[0m %s\n' "${TAG:-kvmove}" "$*" >&2; exit 1; }

# quietly CMD...: run CMD, its output appended to $SETUP_LOG; on failure show the last 40
# lines and stop.
quietly() {
  local log=${SETUP_LOG:-/dev/null}
  if ! "$@" >>"$log" 2>&1; then
    [ "$log" != /dev/null ] && tail -n 40 "$log" >&2
    die "failed: $* (full output: $log)"
  fi
}
