#!/bin/bash
# throwaway (run by ab_cold.sh): /tmp/pkgs/<name>: kvmove at a revision (or the working tree: rev "WT"), renamed to <name>
set -e
rev=$1; name=$2
rm -rf /tmp/pkgs/$name /tmp/pkgs/src && mkdir -p /tmp/pkgs/src
if [ "$rev" = WT ]; then cp -r kvmove /tmp/pkgs/src/kvmove; find /tmp/pkgs/src -name __pycache__ -prune -exec rm -rf {} +;
else git archive $rev kvmove | tar -x -C /tmp/pkgs/src; fi
mv /tmp/pkgs/src/kvmove /tmp/pkgs/$name
cd /tmp/pkgs/$name
grep -rl "kvmove" --include=*.py . | xargs sed -i -E "s/^(\s*)from kvmove(\.| import)/\1from $name\2/; s/^(\s*)import kvmove$/\1import $name as kvmove/; s/^(\s*)import kvmove\.([a-z_.]+)/\1import $name.\2/"
sed -i -E "s/\"kvmove\.([a-z_.]+)\"/\"$name.\1\"/" __init__.py
echo built $rev as $name
