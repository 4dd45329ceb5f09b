"""Every config in deploy/ parses and names only options that exist.

The TOML configs and the units' and compose services' command lines go through the
real ``delaymq`` parser (``parse_args``, which applies a ``--config`` file's tables the
way a server start does); values given as lists (``meta = [...]``), which argparse does
not see one by one, go through the option's own type here. The units are read as the
INI-like files systemd reads; the compose file with a YAML parser.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from delaymq.cli.main import build_parser, parse_args
from delaymq.cli.metrics_endpoint import RequestLine, refusal
from delaymq.cli.options import duration
from delaymq.net.auth import TokenFile, load_tokens

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SYSTEMD = DEPLOY / "systemd"
COMPOSE = DEPLOY / "compose"
SERVER_COMMANDS = ("metaserver", "realtime", "scheduler")


def read_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as {section: {key: [values]}}: keys may repeat, comments start with # or ;."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        assert not line.endswith("\\"), f"{path.name}:{number}: no continued lines here"
        if line.startswith("["):
            assert line.endswith("]"), f"{path.name}:{number}: bad section header {line!r}"
            current = sections.setdefault(line[1:-1], {})
            continue
        key, equals, value = line.partition("=")
        assert equals and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key.strip()), f"{path.name}:{number}: {line!r}"
        assert current is not None, f"{path.name}:{number}: a setting before any section"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def check_config_values(path: Path) -> argparse.Namespace:
    """Parse a server config through ``delaymq --config PATH COMMAND`` and check its list values."""
    import tomllib

    table = tomllib.loads(path.read_text())
    commands = [name for name in SERVER_COMMANDS if name in table]
    assert len(commands) == 1, f"{path.name}: one server table, not {commands}"
    command = commands[0]
    args = parse_args(["--config", str(path), command])
    assert args.command == command
    _, parsers = build_parser()
    actions = {action.dest: action for action in parsers[command]._actions}
    for key, value in table[command].items():
        if isinstance(value, list):
            action = actions[key.replace("-", "_")]
            assert action.type is not None and isinstance(action, argparse._AppendAction), f"{key} takes one value"
            for item in value:
                action.type(item)  # raises ArgumentTypeError naming what is wrong
    return args


def unit_files() -> list[Path]:
    return sorted(SYSTEMD.glob("*.service"))


def test_deploy_holds_a_unit_and_an_example_config_per_server_kind() -> None:
    assert [path.name for path in unit_files()] == [
        "delaymq-metaserver.service",
        "delaymq-realtime@.service",
        "delaymq-scheduler@.service",
    ]
    assert sorted(path.name for path in SYSTEMD.glob("*.toml")) == [
        "metaserver.toml",
        "realtime-1.toml",
        "scheduler-1.toml",
    ]
    assert (SYSTEMD / "README.md").is_file() and (DEPLOY / "spark" / "submit.sh").is_file()


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.toml")), ids=lambda path: path.name)
def test_every_toml_config_parses_through_the_delaymq_parser(path: Path) -> None:
    args = check_config_values(path)
    assert args.data is not None and args.metrics_listen is not None


def test_a_config_with_a_misspelt_option_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The check above can fail: the parser refuses a key that names no option."""
    bad = tmp_path / "bad.toml"
    bad.write_text((SYSTEMD / "realtime-1.toml").read_text().replace("metrics-listen", "metric-listen"))
    with pytest.raises(SystemExit) as exited:
        parse_args(["--config", str(bad), "realtime"])
    assert exited.value.code == 2
    assert "unknown option 'metric-listen' in [realtime]" in capsys.readouterr().err
    bad.write_text(
        (SYSTEMD / "realtime-1.toml").read_text().replace('meta = ["192.0.2.10:20880"]', 'meta = ["192.0.2.10"]')
    )
    with pytest.raises(argparse.ArgumentTypeError, match="is not HOST:PORT"):
        check_config_values(bad)


@pytest.mark.parametrize("path", unit_files(), ids=lambda path: path.name)
def test_every_unit_runs_its_config_as_its_own_user_with_the_settings_operations_need(path: Path) -> None:
    unit = read_unit(path)
    assert set(unit) == {"Unit", "Service", "Install"}
    service = unit["Service"]
    kind = path.name.removeprefix("delaymq-").split("@")[0].removesuffix(".service")
    assert kind in SERVER_COMMANDS
    assert service["User"] == [f"delaymq-{kind}"] and service["Group"] == [f"delaymq-{kind}"]
    assert "MALLOC_ARENA_MAX=2" in service["Environment"]
    assert service["Restart"] == ["on-failure"]
    assert 1 <= duration(service["RestartSec"][0]) <= 60
    assert service["RestartPreventExitStatus"] == ["2"]  # a usage error: restarting cannot help
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]  # rereads the tokens file
    # A group's own token, off the command line; the metaserver dials no server and has none.
    assert service.get("EnvironmentFile") == (None if kind == "metaserver" else ["-/etc/delaymq/%i.token.env"])
    assert int(service["LimitNOFILE"][0]) >= 65536
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    # The user exists: systemd-sysusers makes it from the file beside the units.
    users = (SYSTEMD / "delaymq.sysusers.conf").read_text()
    assert re.search(rf"^u delaymq-{kind}\s", users, re.MULTILINE)


@pytest.mark.parametrize("path", unit_files(), ids=lambda path: path.name)
def test_every_unit_command_line_parses_with_its_example_config(path: Path) -> None:
    """ExecStart is ``delaymq --config /etc/delaymq/NAME.toml COMMAND``; the example NAME.toml
    beside the unit stands in for the installed one (instance ``%i`` of a template: its group)."""
    (exec_start,) = read_unit(path)["Service"]["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0] == "/opt/delaymq/bin/delaymq"
    instance = "metaserver" if "@" not in path.name else f"{path.name.split('@')[0].removeprefix('delaymq-')}-1"
    argv = [arg.replace("%i", instance) for arg in argv[1:]]
    config = argv.index("--config") + 1
    installed = Path(argv[config])
    assert installed.parent == Path("/etc/delaymq")
    argv[config] = str(SYSTEMD / installed.name)
    args = parse_args(argv)
    assert args.command in SERVER_COMMANDS and args.config == SYSTEMD / installed.name
    # The data folder is the unit's StateDirectory.
    (state,) = read_unit(path)["Service"]["StateDirectory"]
    assert args.data == Path("/var/lib") / state.replace("%i", instance)
    assert args.max_connections < int(read_unit(path)["Service"]["LimitNOFILE"][0]) // 2


def load_compose() -> dict:
    data = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    assert isinstance(data, dict)
    return data


def test_the_compose_file_starts_a_metaserver_two_realtime_groups_and_a_scheduler_master_with_a_slave() -> None:
    compose = load_compose()
    services = compose["services"]
    commands = {name: service["command"] for name, service in services.items() if name != "client"}
    parsed = {name: parse_args(argv) for name, argv in commands.items()}
    kinds = sorted(args.command for args in parsed.values())
    assert kinds == ["metaserver", "realtime", "realtime", "scheduler", "scheduler"]
    realtime_groups = {args.group for args in parsed.values() if args.command == "realtime"}
    scheduler_groups = [args.group for args in parsed.values() if args.command == "scheduler"]
    assert len(realtime_groups) == 2 and len(set(scheduler_groups)) == 1  # one group, two members
    (meta,) = [name for name, args in parsed.items() if args.command == "metaserver"]
    meta_address = parsed[meta].listen
    volumes = set(compose["volumes"])
    mounts: set[str] = set()
    for name, args in parsed.items():
        service = services[name]
        assert args.metrics_listen is not None
        if args.command != "metaserver":
            assert args.meta == [meta_address]
            # A group of one realtime member cannot wait for a slave.
            assert args.command == "scheduler" or args.min_insync == 0
        (mount,) = [mount for mount in service["volumes"] if not mount.startswith("./")]
        volume, _, target = mount.partition(":")
        assert volume in volumes and Path(target) == args.data
        mounts.add(volume)
        # Every server checks tokens (the same file, mounted read-only); none listens without.
        assert f"./tokens/tokens.toml:{args.tokens_file}:ro" in service["volumes"] and not args.insecure_listen
        assert service["environment"]["MALLOC_ARENA_MAX"] == "2"
        assert service["image"] == "delaymq:local" and service["build"]["context"] == "."
        # Metrics published on the host's loopback only.
        (port,) = service["ports"]
        assert port.startswith("127.0.0.1:") and port.endswith(":" + args.metrics_listen.rpartition(":")[2])
    assert mounts == volumes  # every server its own volume
    client = services["client"]
    assert parse_args(client["command"]).command == "status"


def test_the_compose_file_reads_in_compose_v1_and_v2_with_defaults_for_its_variables() -> None:
    """docker-compose 1.29 (Debian's) refuses a top-level ``name:``: .env names the project for both."""
    text = (COMPOSE / "compose.yaml").read_text()
    compose = load_compose()
    assert "name" not in compose and "version" not in compose
    env = dict(
        line.split("=", 1) for line in (COMPOSE / ".env").read_text().splitlines() if line and not line.startswith("#")
    )
    assert env == {"COMPOSE_PROJECT_NAME": "delaymq"}
    # Every variable has a default, so the file means the same with none set.
    variables = re.findall(r"\$\{([^}]*)\}", text)
    assert variables and all(re.fullmatch(r"[A-Z_]+:-[^}]+", variable) for variable in variables), variables
    defaults = dict(variable.split(":-") for variable in variables)
    assert defaults == {"BASE_IMAGE": "python:3.11-slim", "DELAYMQ_NOFILE": "65536"}
    for name, service in compose["services"].items():
        if name == "client":
            continue
        assert service["build"]["args"] == {"BASE_IMAGE": "${BASE_IMAGE:-python:3.11-slim}"}
        nofile = service["ulimits"]["nofile"]
        assert nofile == {"soft": "${DELAYMQ_NOFILE:-65536}", "hard": "${DELAYMQ_NOFILE:-65536}"}
        assert service["stop_signal"] == "SIGTERM" and service["restart"] == "on-failure"


def test_the_image_is_built_from_the_wheel_and_runs_as_a_user() -> None:
    lines = [line.strip() for line in (COMPOSE / "Dockerfile").read_text().splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#") and line[0].isupper()]
    # The base can be overridden (a registry without Docker Hub: smoke.sh BASE_IMAGE=...).
    assert instructions[:2] == ["ARG BASE_IMAGE=python:3.11-slim", "FROM ${BASE_IMAGE}"]
    assert "COPY dist/ /tmp/dist/" in lines
    # Into a venv, which works on a distribution's python3 as well (no system-wide pip install).
    assert "RUN python3 -m venv /opt/delaymq \\" in lines
    assert any(
        "/opt/delaymq/bin/python -m pip install --no-cache-dir /tmp/dist/delaymq-*.whl" in line for line in lines
    )
    assert "PATH=/opt/delaymq/bin:$PATH" in lines
    assert "USER delaymq" in lines and 'ENTRYPOINT ["delaymq"]' in lines
    assert "ENV MALLOC_ARENA_MAX=2 \\" in lines
    assert (COMPOSE / ".dockerignore").read_text().split()[-2:] == ["*", "!dist/"]


@pytest.mark.parametrize("script", sorted(DEPLOY.rglob("*.sh")), ids=lambda path: path.name)
def test_every_script_is_executable_bash_that_parses(script: Path) -> None:
    assert script.stat().st_mode & 0o111
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def example_tokens() -> list[dict]:
    import tomllib

    return tomllib.loads((SYSTEMD / "tokens.toml.example").read_text())["token"]


def test_the_tokens_example_loads_and_holds_digests_only() -> None:
    table = load_tokens(SYSTEMD / "tokens.toml.example")
    entries = example_tokens()
    assert len(table) == len(entries) and {entry["name"] for entry in entries} == table.names()
    assert all("token_sha256" in entry and "token" not in entry for entry in entries)


@pytest.mark.parametrize("config", ["realtime-1.toml", "scheduler-1.toml"])
def test_the_tokens_example_gives_each_server_group_a_token_of_its_own(config: str) -> None:
    from fnmatch import fnmatchcase

    args = check_config_values(SYSTEMD / config)
    member = f"{args.command}:{args.group}"
    servers = [entry for entry in example_tokens() if "server" in entry["roles"] and entry.get("servers")]
    (own,) = [entry for entry in servers if any(fnmatchcase(member, p) for p in entry["servers"])]
    assert own["name"] == args.group and own["servers"] == [member]  # that group, and no other
    assert len({tuple(entry["servers"]) for entry in servers}) == len(servers)  # no token shared by groups
    assert args.tokens_file == Path("/etc/delaymq/tokens.toml")


def test_the_tokens_example_binds_consumers_to_their_groups() -> None:
    consumers = [entry for entry in example_tokens() if "consumer" in entry["roles"]]
    assert consumers and all(entry.get("groups") for entry in consumers)


def make_compose_tokens(folder: Path) -> TokenFile:
    made = subprocess.run(
        ["bash", str(COMPOSE / "make-tokens.sh"), str(folder)], capture_output=True, text=True, check=False
    )
    assert made.returncode == 0, made.stderr
    return TokenFile(folder / "tokens.toml")


def secret_of(path: Path) -> str:
    """The secret of a token file: ``DELAYMQ_TOKEN=...`` (an env file) or the bare secret."""
    text = path.read_text().strip()
    return text.removeprefix("DELAYMQ_TOKEN=")


def test_the_compose_tokens_give_each_server_group_its_own_token_in_its_environment(tmp_path: Path) -> None:
    tokens = make_compose_tokens(tmp_path)
    services = load_compose()["services"]
    parsed = {name: parse_args(service["command"]) for name, service in services.items() if name != "client"}
    members = {(args.command, args.group) for args in parsed.values() if args.command != "metaserver"}
    for name, args in parsed.items():
        assert "--token" not in services[name]["command"]  # no secret on a command line
        if args.command == "metaserver":
            assert "env_file" not in services[name]  # it dials no server
            continue
        (env_file,) = services[name]["env_file"]
        assert env_file == f"tokens/{args.group}.env" and (tmp_path / Path(env_file).name).stat().st_mode & 0o077 == 0
        identity = tokens.table.identify(secret_of(tmp_path / Path(env_file).name))
        assert identity is not None
        assert {member for member in members if identity.may_be(*member)} == {(args.command, args.group)}
    (client_env,) = services["client"]["env_file"]
    client = tokens.table.identify(secret_of(tmp_path / Path(client_env).name))
    assert client is not None and client.roles == {"producer", "consumer"} and client.allows_group("smoke")
    assert not any(client.may_be(*member) for member in members)


def test_the_compose_prometheus_token_reads_the_metrics_and_is_no_server(tmp_path: Path) -> None:
    tokens = make_compose_tokens(tmp_path)
    secret = secret_of(tmp_path / "prometheus.token")
    identity = tokens.table.identify(secret)
    assert identity is not None and identity.servers == ()
    assert refusal(RequestLine("GET", "/metrics", f"Bearer {secret}"), tokens) is None
    client = secret_of(tmp_path / "client.env")
    assert refusal(RequestLine("GET", "/metrics", f"Bearer {client}"), tokens) is not None


def test_make_tokens_keeps_the_secrets_it_made(tmp_path: Path) -> None:
    make_compose_tokens(tmp_path)
    before = {path.name: path.read_text() for path in tmp_path.iterdir()}
    make_compose_tokens(tmp_path)
    assert {path.name: path.read_text() for path in tmp_path.iterdir()} == before
    assert len(set(before.values())) == len(before)  # a secret each
