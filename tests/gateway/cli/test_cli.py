"""`python -m gateway`: each command asks only for the secrets it uses, and says which are missing."""

from __future__ import annotations

import json
import os
import pickle
import socket
from pathlib import Path

import pytest
import uvicorn

from gateway.api.http_protocol import GatewayHttpProtocol, LimitedConfig
from gateway.cli import main as cli
from gateway.store.migrate import upgrade

POLICY = Path("policies/default.yaml")


def _without_gateway_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GATEWAY_* variable of this machine's reaches the command under test."""
    for name in [n for n in os.environ if n.startswith("GATEWAY_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def database(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A migrated SQLite database in GATEWAY_DATABASE_URL, and no other GATEWAY_* variable."""
    _without_gateway_settings(monkeypatch)
    url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    upgrade(url)
    monkeypatch.setenv("GATEWAY_DATABASE_URL", url)
    return url


class _ServerStarted(AssertionError):
    """serve got as far as starting uvicorn."""


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """serve fails the test instead of listening, should it get that far."""

    def started(*args: object, **kwargs: object) -> None:
        raise _ServerStarted("serve started a server without its secrets")

    monkeypatch.setattr(cli, "CleanExitServer", started)
    monkeypatch.setattr(cli, "WorkerSupervisor", started)
    monkeypatch.setattr(uvicorn, "run", started)


@pytest.mark.usefixtures("database", "no_server")
@pytest.mark.parametrize(
    ("env", "missing"),
    [
        ({}, "GATEWAY_MASTER_KEY, GATEWAY_KEY_SECRET"),
        ({"GATEWAY_MASTER_KEY": "m"}, "GATEWAY_KEY_SECRET"),
        ({"GATEWAY_MASTER_KEY": "", "GATEWAY_KEY_SECRET": "s"}, "GATEWAY_MASTER_KEY"),
    ],
)
def test_serve_refuses_to_start_without_its_secrets_and_names_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], env: dict[str, str], missing: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["serve", "--policy", str(POLICY), "--workers", "2"]) == 2
    assert f"error: {missing} must be set to a non-empty value" in capsys.readouterr().err


@pytest.mark.usefixtures("database", "no_server")
@pytest.mark.parametrize("redis", [None, "redis://127.0.0.1:6379/0"])
def test_serve_with_several_workers_and_no_redis_warns_that_limits_multiply(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], redis: str | None
) -> None:
    monkeypatch.setenv("GATEWAY_MASTER_KEY", "m")
    monkeypatch.setenv("GATEWAY_KEY_SECRET", "s")
    if redis:
        monkeypatch.setenv("GATEWAY_REDIS_URL", redis)
    with pytest.raises(_ServerStarted):
        cli.main(["serve", "--policy", str(POLICY), "--workers", "3", "--port", "0"])
    warned = "3 workers without GATEWAY_REDIS_URL" in capsys.readouterr().err
    assert warned == (redis is None)


@pytest.mark.usefixtures("database")
def test_keys_create_needs_the_key_secret_but_not_the_master_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["keys", "create", "--name", "app"]) == 2
    assert "error: GATEWAY_KEY_SECRET must be set" in capsys.readouterr().err
    monkeypatch.setenv("GATEWAY_KEY_SECRET", "s")
    assert cli.main(["keys", "create", "--name", "app"]) == 0
    assert json.loads(capsys.readouterr().out)["key"].startswith("sk-")


@pytest.mark.usefixtures("database")
def test_reports_and_policy_checks_run_without_the_secrets(capsys: pytest.CaptureFixture[str]) -> None:
    report = ["report", "spend", "--from", "2026-01-01", "--to", "2026-01-31", "--format", "json"]
    assert cli.main(report) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == []
    assert cli.main(["policy", "check", str(POLICY)]) == 0


@pytest.mark.usefixtures("database")
@pytest.mark.parametrize("workers", [1, 2])
def test_serve_runs_uvicorn_with_the_limits_from_the_settings(
    monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    limits = {
        "GATEWAY_MAX_HEADER_BYTES": "16384", "GATEWAY_HEADER_TIMEOUT": "7.5",
        "GATEWAY_LIMIT_CONCURRENCY": "321", "GATEWAY_KEEP_ALIVE_TIMEOUT": "9", "GATEWAY_BACKLOG": "77",
    }  # fmt: skip
    for name, value in {"GATEWAY_MASTER_KEY": "m", "GATEWAY_KEY_SECRET": "s", **limits}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GATEWAY_POLICY_PATH", "elsewhere.yaml")  # the --policy flag wins over it
    before = dict(os.environ)
    started: list[uvicorn.Config] = []

    class Recorder:
        def __init__(self, config: uvicorn.Config, sockets: list[socket.socket] | None = None) -> None:
            started.append(config)
            for sock in sockets or []:
                sock.close()
            self.started = self.signalled = True

        def run(self) -> None:
            pass

    monkeypatch.setattr(cli, "CleanExitServer", Recorder)
    monkeypatch.setattr(cli, "WorkerSupervisor", Recorder)
    argv = ["serve", "--policy", str(POLICY), "--port", "0", "--workers", str(workers)]
    assert cli.main(argv) == 0
    assert dict(os.environ) == before  # the workers get the settings in their config, not our environment
    (config,) = started
    assert pickle.loads(pickle.dumps(config.app)).settings.policy_path == POLICY
    assert isinstance(config, LimitedConfig)
    assert (config.max_header_bytes, config.header_timeout) == (16384, 7.5)
    assert (config.limit_concurrency, config.timeout_keep_alive, config.backlog) == (321, 9, 77)
    assert config.h11_max_incomplete_event_size == 16384
    assert pickle.loads(pickle.dumps(config)).max_header_bytes == 16384  # spawned workers get it whole
    config.load()
    assert config.http_protocol_class is GatewayHttpProtocol
    assert config.ws == "none" and not config.server_header


@pytest.mark.usefixtures("database")
@pytest.mark.parametrize(("env", "flag", "served"), [
    ("elsewhere.yaml", None, Path("elsewhere.yaml")),  # GATEWAY_POLICY_PATH, as docs/gateway.md says
    ("elsewhere.yaml", POLICY, POLICY),  # the flag wins over the variable
    (None, None, POLICY),  # neither: policies/default.yaml
])  # fmt: skip
def test_serve_without_policy_flag_serves_gateway_policy_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: str | None, flag: Path | None, served: Path
) -> None:
    monkeypatch.setenv("GATEWAY_MASTER_KEY", "m")
    monkeypatch.setenv("GATEWAY_KEY_SECRET", "s")
    (tmp_path / "policies").mkdir()
    (tmp_path / POLICY).write_bytes(POLICY.read_bytes())
    (tmp_path / "elsewhere.yaml").write_bytes(POLICY.read_bytes())
    monkeypatch.chdir(tmp_path)
    if env:
        monkeypatch.setenv("GATEWAY_POLICY_PATH", env)
    started: list[uvicorn.Config] = []

    class Recorder:
        def __init__(self, config: uvicorn.Config) -> None:
            started.append(config)
            self.started = self.signalled = True

        def run(self) -> None:
            pass

    monkeypatch.setattr(cli, "CleanExitServer", Recorder)
    assert cli.main(["serve", "--port", "0", *(["--policy", str(flag)] if flag else [])]) == 0
    (config,) = started
    assert isinstance(config.app, cli.AppFactory)
    assert config.app.settings.policy_path == served


@pytest.mark.usefixtures("database")
@pytest.mark.parametrize("day", ["20261128", "2026-W48-6", "2026-11-28T00:00", "2026-02-30"])
def test_report_days_are_yyyy_mm_dd_as_the_admin_api_and_console_read_them(
    capsys: pytest.CaptureFixture[str], day: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["report", "spend", "--from", day, "--to", "2026-11-30"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --from: " in err and ("must be a day as YYYY-MM-DD" in err or "not a day of" in err)


def test_a_report_without_a_database_says_so_and_creates_none(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    _without_gateway_settings(monkeypatch)
    data = tmp_path / "data"
    monkeypatch.setenv("GATEWAY_DATA_DIR", str(data))
    assert cli.main(["report", "spend", "--from", "2026-11-01", "--to", "2026-11-30"]) == 2
    err = capsys.readouterr().err
    assert f"there is no database at {data / 'gateway.db'}" in err and "GATEWAY_DATABASE_URL" in err
    assert not data.exists()  # a read-only command created neither the file nor its folder


@pytest.mark.usefixtures("database")
def test_an_html_report_outside_the_repository_asks_for_the_policy(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    policy = POLICY.resolve()
    monkeypatch.chdir(tmp_path)
    html = ["report", "spend", "--from", "2026-11-01", "--to", "2026-11-30", "--format", "html"]
    assert cli.main(html) == 2
    assert "give --policy FILE or set GATEWAY_POLICY_PATH" in capsys.readouterr().err
    assert cli.main([*html, "--policy", str(policy)]) == 0
    assert capsys.readouterr().out.lstrip().lower().startswith("<!doctype html>")


@pytest.mark.usefixtures("database")
@pytest.mark.parametrize(
    "options",
    [
        ["--name", "a\x1b[31mred"],  # a terminal escape, refused by the admin API too
        ["--name", "x" * 201],
        ["--name", "ok", "--team", ""],
        ["--name", "ok", "--metadata", "[1]"],  # metadata is an object
        ["--name", "ok", "--metadata", '{"a": NaN}'],
        ["--name", "ok", "--metadata", '{"a": ' * 40 + "1" + "}" * 40],  # past 32 levels
        ["--name", "ok", "--expires-in-days", "1e308"],
    ],
)
def test_keys_create_refuses_what_the_admin_api_refuses_and_stores_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], options: list[str]
) -> None:
    monkeypatch.setenv("GATEWAY_KEY_SECRET", "s")
    assert cli.main(["keys", "create", *options]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert cli.main(["keys", "create", "--name", "ok", "--metadata", '{"a": [1, {"b": "c"}]}']) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["metadata"] == {"a": [1, {"b": "c"}]} and made["name"] == "ok"


@pytest.mark.usefixtures("database", "no_server")
def test_serve_refuses_a_pipe_at_once_and_policy_check_reads_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`serve --policy <(...)`: the check read the pipe to its end, and the server's own read then
    found it empty (or, a FIFO, blocked its start for good). A command that reads once may."""
    import threading

    monkeypatch.setenv("GATEWAY_MASTER_KEY", "m")
    monkeypatch.setenv("GATEWAY_KEY_SECRET", "s")
    fifo = tmp_path / "policy.yaml"
    os.mkfifo(fifo)
    assert cli.main(["serve", "--policy", str(fifo), "--port", "0"]) == 2  # no writer: no wait either
    assert "not a regular file" in capsys.readouterr().err
    writer = threading.Thread(target=fifo.write_text, args=(POLICY.read_text(),))
    writer.start()
    try:
        assert cli.main(["policy", "check", str(fifo)]) == 0
    finally:
        writer.join(5)


@pytest.mark.usefixtures("database")
def test_serve_exits_3_when_a_worker_fails_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn's supervisor stops by itself when a worker fails to start: that was exit 0, and
    nothing that restarts services saw a failed start."""
    monkeypatch.setenv("GATEWAY_MASTER_KEY", "m")
    monkeypatch.setenv("GATEWAY_KEY_SECRET", "s")

    class Stopped:
        signalled = False

        def __init__(self, config: uvicorn.Config, sockets: list[socket.socket]) -> None:
            for sock in sockets:
                sock.close()

        def run(self) -> None:
            pass

    monkeypatch.setattr(cli, "WorkerSupervisor", Stopped)
    assert cli.main(["serve", "--policy", str(POLICY), "--port", "0", "--workers", "2"]) == 3


@pytest.mark.usefixtures("no_server")
def test_serve_names_a_database_it_cannot_use_in_one_line_before_any_worker_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A database never migrated, or unreachable, was a traceback from every worker (exit 3)."""
    _without_gateway_settings(monkeypatch)
    monkeypatch.setenv("GATEWAY_MASTER_KEY", "m")
    monkeypatch.setenv("GATEWAY_KEY_SECRET", "s")
    for url, said in (
        (f"sqlite+aiosqlite:///{tmp_path / 'never.db'}", "error: the database schema is at revision none"),
        ("postgresql+asyncpg://postgres@127.0.0.1:1/none", "error: "),
    ):
        monkeypatch.setenv("GATEWAY_DATABASE_URL", url)
        assert cli.main(["serve", "--policy", str(POLICY), "--port", "0", "--workers", "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(said) and "Traceback" not in err, err


@pytest.mark.usefixtures("database", "no_server")
def test_serve_checks_the_policys_complexity_weights_as_policy_check_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GATEWAY_MASTER_KEY", "m")
    monkeypatch.setenv("GATEWAY_KEY_SECRET", "s")
    policy = tmp_path / "p.yaml"
    text = POLICY.read_text().replace("  auto:", "  auto:\n    complexity_weights: {no_such_feature: 1.0}", 1)
    policy.write_text(text)
    assert cli.main(["policy", "check", str(policy)]) == 1
    assert cli.main(["serve", "--policy", str(policy), "--port", "0"]) == 2
    assert "no_such_feature" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "99999"],
        ["serve", "--port", "-1"],
        ["serve", "--workers", "0"],
        ["dev", "--engine-port", "70000"],
    ],
)
def test_ports_and_worker_counts_out_of_range_are_refused(argv: list[str]) -> None:
    """--port 99999 was bound as 34463 (its remainder), --workers 0 ran one."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2


def test_read_only_commands_create_no_database_and_wait_needs_a_number(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _without_gateway_settings(monkeypatch)
    monkeypatch.setenv("GATEWAY_KEY_SECRET", "s")
    monkeypatch.setenv("GATEWAY_DATABASE_URL", f"sqlite+aiosqlite:///{tmp_path / 'no' / 'gateway.db'}")
    assert cli.main(["db", "current"]) == 2
    assert cli.main(["keys", "create", "--name", "k"]) == 2
    assert "there is no database at" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()
    assert cli.main(["db", "wait", "--timeout", "nan"]) == 2


@pytest.mark.usefixtures("database")
def test_a_csv_report_ends_with_its_last_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["report", "spend", "--from", "2026-01-01", "--to", "2026-01-31", "--format", "csv"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\r\n") and not out.endswith("\n\n"), repr(out[-10:])


def test_a_database_a_newer_release_migrated_is_named_as_such(tmp_path: Path) -> None:
    """`db upgrade` was the advice for a schema newer than the code, which cannot help."""
    import asyncio

    import sqlalchemy

    from gateway.store.migrate import SchemaMismatchError, ensure_schema

    url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    upgrade(url)
    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'g.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '0999'")
    engine.dispose()
    with pytest.raises(SchemaMismatchError, match="0999, which this gateway does not know"):
        asyncio.run(ensure_schema(url, auto_upgrade=True))


@pytest.mark.parametrize("url", ["garbage", "postgresql://u@h/db", "mysql://u@h/db"])
def test_a_database_url_of_another_driver_says_which_to_use(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], url: str
) -> None:
    """SQLAlchemy's ArgumentError, or `No module named 'psycopg'`, as a traceback."""
    monkeypatch.setenv("GATEWAY_DATABASE_URL", url)
    assert cli.main(["db", "current"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: GATEWAY_DATABASE_URL must be sqlite+aiosqlite") and "Traceback" not in err
    assert "u@h" not in err  # (a password would be there too)


def test_a_bad_setting_is_one_line_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pydantic's four lines named `key_cache_ttl` and linked its docs."""
    monkeypatch.setenv("GATEWAY_KEY_CACHE_TTL", "abc")
    assert cli.main(["db", "current"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: GATEWAY_KEY_CACHE_TTL: ") and err.count("\n") == 1, err
