# throwaway: bash bench/results/cpu-amd-epyc-2c-20261205-numpy-indices/ab_cold.sh <rev> <processes>
# A/B in one process: kvmove_a = revision <rev>, kvmove_b = the working tree (copies renamed
# under /tmp/pkgs by mkpkg.sh); <processes> runs of ab_cold.py, the set-up order swapped
# between them. Run from the repository root, with .venv-vllm set up.
here=bench/results/cpu-amd-epyc-2c-20261205-numpy-indices
bash $here/mkpkg.sh ${1:-HEAD} kvmove_a >/dev/null && bash $here/mkpkg.sh WT kvmove_b >/dev/null
for i in $(seq ${2:-4}); do
  f=$([ $((i % 2)) = 1 ] && echo a || echo b)
  PYTHONPATH=/tmp/pkgs:. .venv-vllm/bin/python $here/ab_cold.py 60 $f 2>&1 | grep "outside:"
done
