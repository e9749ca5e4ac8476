"""The real-Prometheus harness works: Prometheus scrapes itself and answers queries."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.deploy.checks import require
from tests.deploy.prometheus_harness import (
    PrometheusError,
    fetch_text,
    promtool_check_metrics,
    running_prometheus,
)


def test_prometheus_scrapes_itself_and_answers_instant_queries(tmp_path: Path) -> None:
    version = subprocess.run(
        [require("prometheus"), "--version"], capture_output=True, text=True, check=True
    )
    expected = re.search(r"version (\S+)", version.stdout + version.stderr)
    assert expected is not None

    with running_prometheus({}, tmp_path) as prom:
        prom.wait_for_up("prometheus")
        [(labels, value)] = prom.query('prometheus_build_info{job="prometheus"}')
        assert value == 1
        assert labels["version"] == expected.group(1)
        assert labels["instance"] == prom.url.removeprefix("http://")

        # Scraped every second: three scrapes land within a few seconds.
        samples = prom.wait_for(
            'count_over_time(up{job="prometheus"}[1m])', lambda v: v >= 3, timeout=10
        )
        assert samples >= 3
        assert prom.query_value('absent(up{job="nowhere"})') == 1
        assert prom.query('up{job="nowhere"}') == []

        [target] = prom.targets()
        assert target["health"] == "up"

        with pytest.raises(PrometheusError, match="bad_data"):
            prom.query("sum(")

    assert prom.process.returncode is not None  # stopped on exit


def test_promtool_check_metrics_accepts_good_and_flags_bad_expositions(tmp_path: Path) -> None:
    with running_prometheus({}, tmp_path) as prom:
        own = fetch_text(f"{prom.url}/metrics")
    assert "prometheus_build_info" in own
    parsed = promtool_check_metrics(own)
    # Prometheus' own exposition parses (lint notes, if any, come with exit status 3).
    assert parsed.returncode in (0, 3), parsed.stdout + parsed.stderr

    clean = "# HELP demo_total A demo.\n# TYPE demo_total counter\ndemo_total 1\n"
    assert promtool_check_metrics(clean).returncode == 0

    unsuffixed = "# HELP demo A demo.\n# TYPE demo counter\ndemo 1\n"
    linted = promtool_check_metrics(unsuffixed)
    assert linted.returncode != 0
    assert "_total" in linted.stdout + linted.stderr

    broken = promtool_check_metrics("demo{{ 1\n")
    assert broken.returncode != 0
