"""`policy check`, `route eval` and `route explain` from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DEV = Path(__file__).resolve().parents[4] / "shared" / "data" / "routing_dev.jsonl"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args], capture_output=True, text=True, timeout=120,
        env=None if env is None else {**os.environ, **env},
    )  # fmt: skip


def test_policy_check_exits_0_for_a_valid_file_and_1_naming_the_path_for_a_broken_one(tmp_path: Path) -> None:
    assert _cli("policy", "check", "policies/default.yaml").returncode == 0
    broken = tmp_path / "broken.yaml"
    broken.write_text(Path("policies/default.yaml").read_text().replace("threshold: 0.575", "threshold: 7"))
    done = _cli("policy", "check", str(broken))
    assert done.returncode == 1
    assert "routes.auto.tiers[1].threshold: must be between 0 and 1" in done.stdout


def test_route_explain_shows_what_drove_the_score_and_where_it_goes() -> None:
    done = _cli("route", "explain", "Prove that there are infinitely many primes, rigorously, step by step.")
    assert done.returncode == 0, done.stderr
    assert "score" in done.stdout and "tier=complex" in done.stdout
    assert "chain   gpt-4o-mini" in done.stdout and "contribution" in done.stdout


def test_route_explain_applies_team_overrides_and_reads_message_files(tmp_path: Path) -> None:
    messages = tmp_path / "m.json"
    messages.write_text(json.dumps([{"role": "user", "content": "hi there"}]))
    done = _cli("route", "explain", "--messages", str(messages))
    assert done.returncode == 0 and "tier=simple" in done.stdout
    done = _cli("route", "explain", "--route", "nope", "hi")
    assert done.returncode == 2 and "neither a model nor a route" in done.stderr


@pytest.mark.skipif(not DEV.exists(), reason="the labelled dev set is not on this machine")
def test_route_eval_on_the_dev_set_meets_the_accuracy_target() -> None:
    done = _cli("route", "eval", "--data", str(DEV))
    assert done.returncode == 0, done.stderr
    figures = dict(zip(done.stdout.split()[::2], done.stdout.split()[1::2], strict=False))
    assert float(figures["accuracy"]) >= 0.9 and int(figures["n"]) == 120


CAPABLE = """
backends:
  local: {type: engine, urls: ["http://127.0.0.1:9"]}
  gpu: {type: engine, urls: ["http://127.0.0.1:10"]}
models:
  small: {backend: local, capabilities: {tools: false}, context_length: 8192}
  big: {backend: gpu, capabilities: {tools: true, vision: false}}
routes:
  auto:
    tiers:
      - {name: simple, threshold: 0, candidates: [small]}
      - {name: complex, threshold: 0.99, candidates: [big]}
"""


def test_route_explain_shows_the_capability_filter_and_the_refusal(tmp_path: Path) -> None:
    policy, body = tmp_path / "p.yaml", tmp_path / "body.json"
    policy.write_text(CAPABLE)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body.write_text(json.dumps({"messages": [{"role": "user", "content": "weather?"}], "tools": tools}))
    done = _cli("route", "explain", "--policy", str(policy), "--messages", str(body))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "needs   tools (by `tools`)" in lines
    small = next(line.split() for line in lines if line.startswith("  small"))
    big = next(line.split() for line in lines if line.startswith("  big"))
    assert small == ["small", "no", "d", "?", "?", "?", "?", "8192", "d"]  # declared, the rest unknown
    assert big == ["big", "yes", "d", "?", "?", "no", "d", "?", "?"]
    assert (
        "reason  complexity" in done.stdout and "-> tier simple -> tier complex (needs tools)" in done.stdout
    )
    assert "chain   big" in lines and "skipped small (lacks tools)" in lines
    done = _cli("route", "explain", "--policy", str(policy), "--messages", str(body), "--route", "small")
    assert done.returncode == 0, done.stderr
    refused = (
        "refused 400 model_capability_missing (param tools): no model for 'small' can serve this request"
    )
    assert refused in done.stdout and done.stdout.rstrip().endswith("small: lacks tools")


def test_route_explain_reads_the_gateways_own_policy_unless_policy_names_another(tmp_path: Path) -> None:
    """As `serve`: --policy, else GATEWAY_POLICY_PATH, else policies/default.yaml."""
    policy = tmp_path / "p.yaml"
    policy.write_text(CAPABLE)
    env = {"GATEWAY_POLICY_PATH": str(policy)}
    done = _cli("route", "explain", "hi", env=env)
    assert done.returncode == 0, done.stderr
    assert "chain   small" in done.stdout.splitlines()  # CAPABLE's simple tier, not the default policy's
    done = _cli("route", "explain", "--policy", "policies/default.yaml", "hi", env=env)
    assert done.returncode == 0, done.stderr
    assert "chain   small" not in done.stdout.splitlines()
    env = {"GATEWAY_POLICY_PATH": str(tmp_path / "absent.yaml")}
    done = _cli("route", "explain", "hi", env=env)
    assert done.returncode != 0 and "absent.yaml" in done.stderr


@pytest.mark.parametrize("row", ["[1]", '{"label": "Complex", "messages": []}', '{"messages": []}'])
def test_route_eval_refuses_a_row_it_cannot_read_naming_the_line(tmp_path: Path, row: str) -> None:
    """A row that is not an object was a traceback; a label other than simple or complex was
    counted as simple, and the accuracy figure silently wrong."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"label": "simple", "messages": [{"role": "user", "content": "hi"}]}\n' + row + "\n")
    done = _cli("route", "eval", "--policy", "policies/default.yaml", "--data", str(data))
    assert done.returncode == 2 and done.stderr.startswith(f"error: {data}:2: "), done.stderr
