#!/usr/bin/env bash
# Two `mfs serve` replicas of the tiny family behind the SGLang Model Gateway (pip install 'mfs-serve[fleet]'),
# the front at http://127.0.0.1:8000, sessions kept on one replica. docs/SCALE.md has the details.
set -euo pipefail
cd "$(dirname "$0")/.."
mfs fleet up --replicas 2 --config examples/tiny-cpu.yaml --port 8000
