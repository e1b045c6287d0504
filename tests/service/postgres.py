"""A private PostgreSQL cluster for the tests and the benchmarks: Debian's server binaries
(``initdb``, ``pg_ctl`` under /usr/lib/postgresql/*/bin, installed by scripts/setup.sh), a cluster
in a temporary directory, listening on a free loopback port and a socket in that directory.

initdb refuses to run as root: as root the cluster belongs to the ``postgres`` system user (which
Debian's package creates; created here with ``useradd`` when absent) and its commands run through
``runuser``.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

__all__ = ["PostgresCluster", "server_binaries"]

_USER = "postgres"


def server_binaries() -> Path | None:
    """The newest installed server's bin directory (with ``initdb`` and ``pg_ctl``), or ``None``."""
    found = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb") if Path(p).with_name("pg_ctl").exists()]
    found.sort(key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    return found[-1] if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresCluster:
    """``initdb`` + ``pg_ctl start`` in a temporary directory; :meth:`create_database` gives each
    user a database of its own; :meth:`stop` ends the server and removes the directory.

    ``durable=False`` (tests) turns fsync off: the tests kill controllers, not the database's
    machine. The benchmarks keep PostgreSQL's defaults (fsync, synchronous_commit on)."""

    def __init__(self, *, durable: bool = False) -> None:
        bindir = server_binaries()
        if bindir is None:
            raise FileNotFoundError("PostgreSQL server binaries (initdb, pg_ctl) not found under /usr/lib/postgresql/*/bin")
        self.bindir = bindir
        self.as_root = os.geteuid() == 0
        if self.as_root:
            try:
                pwd.getpwnam(_USER)
            except KeyError:
                subprocess.run(["useradd", "--system", "--no-create-home", _USER], check=True)
        self.dir = Path(tempfile.mkdtemp(prefix="trainguard-pg-"))
        if self.as_root:
            shutil.chown(self.dir, _USER)
        self.data = self.dir / "data"
        self.port = _free_port()
        self.user = _USER if self.as_root else pwd.getpwuid(os.geteuid()).pw_name
        self._names = itertools.count(1)
        self._run("initdb", "-D", str(self.data), "-U", self.user, "--auth=trust", "-E", "UTF8", "--locale=C",
                  *([] if durable else ["--no-sync"]))
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c max_connections=200"
        if not durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "server.log"), "-w", "-t", "60", "-o", options, "start")

    def _run(self, tool: str, *args: str) -> str:
        cmd = [str(self.bindir / tool), *args]
        if self.as_root:
            cmd = ["runuser", "-u", _USER, "--", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=self.dir)
        if out.returncode != 0:
            log = (self.dir / "server.log").read_text() if (self.dir / "server.log").exists() else ""
            raise RuntimeError(f"{tool} failed ({out.returncode}): {out.stdout}{out.stderr}{log}")
        return out.stdout

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, prefix: str = "tg") -> str:
        """A new empty database; its URL."""
        import psycopg

        name = f"{prefix}_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
