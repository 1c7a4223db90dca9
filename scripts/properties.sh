#!/usr/bin/env bash
# The property harness's long profile (tests/properties, docs/DEVELOPERS.md): rounds of random examples,
# each round a new hypothesis seed, until --minutes have passed. Each failure is printed as hypothesis
# reports it (shrunk to its smallest example) with the command line that reruns it
# (tests/properties/reproduce.py), and is kept in hypothesis's example database (.hypothesis/), which
# the next run tries first. Ends with a list of every failure's reproduction.
#   bash scripts/properties.sh --minutes 30 [pytest arguments, e.g. -k decoding]
# EXAMPLES (default 25): examples per property per round. The option contract (fairseq's own options through its
# tools: tests/properties/test_fairseq_options.py) runs too, each of its examples a fairseq command.
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=30
if [[ ${1:-} == --minutes ]]; then
  minutes=$2
  shift 2
fi
bash scripts/setup_env.sh
deadline=$(( $(date +%s) + 60 * minutes ))
log=$(mktemp -d)
round=0
while (( $(date +%s) < deadline - 30 )); do
  round=$((round + 1))
  seed=$RANDOM$RANDOM
  echo "[properties] round $round, seed $seed, $(( (deadline - $(date +%s)) / 60 )) min left"
  if FWP_PROPERTIES=long FWP_PROPERTIES_EXAMPLES=${EXAMPLES:-25} timeout $((deadline - $(date +%s))) \
      .venv/bin/python -m pytest -q -p no:cacheprovider -n "$(nproc)" -m "not slow or options" --hypothesis-seed="$seed" tests/properties \
      "$@" > "$log/round-$round.txt" 2>&1; then
    tail -1 "$log/round-$round.txt"
  else
    cat "$log/round-$round.txt"
  fi
done
echo "[properties] $round rounds in $minutes min; failures (each rerun by its command line):"
grep -h "reproduce: " "$log"/round-*.txt | sed 's/^[ |E]*//' | sort -u || echo "  none"
