"""The operator's ``/metrics`` behind a bearer token (issue 16: every endpoint authenticated).

The real metrics server on loopback with ``--metrics-token-file``: no token, a wrong token
and a token without the ``Bearer`` scheme get 401; the file's token gets the metrics; a
rotated file takes effect at the next scrape and an emptied one admits no one. Serving
beyond loopback without a token, or with an unreadable or empty file, is refused by name.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rolloutrun_operator.cli import operator_config
from rolloutrun_operator.metrics import Metrics, token_problem
from rolloutrun_runtime.cli import build_parser


def scrape(port: int, authorization: str | None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        assert error.headers["WWW-Authenticate"].startswith("Bearer")
        return error.code, error.read().decode()


def test_only_the_metrics_token_gets_the_operators_metrics(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-metrics\n")
    metrics = Metrics()
    port = metrics.serve(0, "127.0.0.1", str(token))
    try:
        for refused in (None, "Bearer wrong", "s3cret-metrics", "Bearer s3cret-metrics2"):
            status, body = scrape(port, refused)
            assert status == 401, refused
            assert "rolloutrun_runs" not in body
        status, body = scrape(port, "Bearer s3cret-metrics")
        assert status == 200
        names = {family.name for family in text_string_to_metric_families(body)}
        assert {"rolloutrun_runs", "rolloutrun_reconcile_duration_seconds"} <= names
        token.write_text("rotated")  # a rotated Secret: the next scrape reads it
        assert scrape(port, "Bearer s3cret-metrics")[0] == 401
        assert scrape(port, "Bearer rotated")[0] == 200
        token.write_text("")  # emptied (or gone): fails closed
        assert scrape(port, "Bearer ")[0] == 401
        token.unlink()
        assert scrape(port, "Bearer rotated")[0] == 401
    finally:
        metrics.close()


def test_serving_beyond_loopback_needs_a_token(tmp_path: Path) -> None:
    assert token_problem("127.0.0.1", None) is None
    assert token_problem("::1", None) is None
    problem = token_problem("0.0.0.0", None)
    assert problem is not None and "--metrics-token-file" in problem
    with pytest.raises(ValueError, match="beyond loopback"):
        Metrics().serve(0, "0.0.0.0")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert "is empty" in str(token_problem("0.0.0.0", str(empty)))
    assert "cannot read" in str(token_problem("0.0.0.0", str(tmp_path / "missing")))


def test_the_command_refuses_open_metrics_beyond_loopback(tmp_path: Path) -> None:
    parser = build_parser()
    args = parser.parse_args(["operator", "--metrics-address", "0.0.0.0"])
    with pytest.raises(SystemExit, match="--metrics-token-file"):
        operator_config(args)
    token = tmp_path / "token"
    token.write_text("t")
    args = parser.parse_args(
        ["operator", "--metrics-address", "0.0.0.0", "--metrics-token-file", str(token)]
    )
    assert operator_config(args).options.metrics_token_file == str(token)
    off = parser.parse_args(["operator", "--metrics-address", "0.0.0.0", "--metrics-port", "0"])
    assert operator_config(off).options.metrics_port is None
