#!/usr/bin/env bash
# Quick static check of the deployment files, with the real tools:
#   docker-compose config -q           docker-compose.yml
#   kubectl kustomize | validate       deploy/k8s/base and every overlay, strictly, against the
#                                      offline schemas of Kubernetes 1.29 and 1.33
#                                      (kubernetes-validate; CRDs such as ServiceMonitor skipped
#                                      by kind, see tests/deploy/checks.py)
#   promtool check config              deploy/prometheus/prometheus.yml
#   dashboard queries                  only contract metric names; parsed by promtool
# The full set (Dockerfile, sidecar, sizing, a fresh-venv install) is
# `pytest tests/deploy`. Missing programs: scripts/install-system-deps.sh.
#
# Usage: scripts/check_deploy.sh [PYTHON]   (default: .venv/bin/python, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-}
if [[ -z $python ]]; then
    if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
exec "$python" -m tests.deploy.checks
