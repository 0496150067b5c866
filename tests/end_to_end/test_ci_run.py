"""``.ci/run``'s redis-server install (``.ci/run --install-redis``, the step CI runs before the tests).

Run against stand-ins on a PATH of their own (``apt-get``, ``sudo``, ``id`` write what they were called
with), so nothing is installed: the install happens only when redis-server is missing, as root or
through ``sudo -n`` (never a prompt), with ``DEBIAN_FRONTEND=noninteractive``, ``apt-get update`` first,
and an install that leaves no redis-server is a loud failure.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from tests.helpers import REPO


APT = """#!/bin/bash
echo "apt-get $* DEBIAN_FRONTEND=${DEBIAN_FRONTEND:-unset}" >> "$LOG"
if [ "$1" = install ] && [ -z "${APT_BROKEN:-}" ]; then
  printf '#!/bin/bash\\n' > "$BIN/redis-server"; chmod +x "$BIN/redis-server"
fi
exit "${APT_RC:-0}"
"""
SUDO = """#!/bin/bash
echo "sudo $*" >> "$LOG"
[ "$1" = -n ] || exit 9
shift
exec "$@"
"""


def _bin(tmp_path: Path, uid: int, sudo: bool, redis: bool) -> Path:
    b = tmp_path / "bin"
    b.mkdir()
    for tool in ("bash", "env", "dirname", "chmod"):
        (b / tool).symlink_to(shutil.which(tool))
    scripts = {"apt-get": APT, "id": f"#!/bin/bash\necho {uid}\n"}
    if sudo:
        scripts["sudo"] = SUDO
    if redis:
        scripts["redis-server"] = "#!/bin/bash\n"
    for name, text in scripts.items():
        (b / name).write_text(text)
        (b / name).chmod(0o755)
    return b


def _run(tmp_path: Path, uid: int = 0, sudo: bool = True, redis: bool = False, **env) -> tuple[int, str, list[str]]:
    b, log = _bin(tmp_path, uid, sudo, redis), tmp_path / "calls.log"
    e = {"PATH": str(b), "LOG": str(log), "BIN": str(b), "HOME": str(tmp_path), **env}
    r = subprocess.run([str(b / "bash"), str(REPO / ".ci" / "run"), "--install-redis"], env=e, capture_output=True,
                       text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return r.returncode, r.stderr, calls


@pytest.mark.parametrize("uid, prefix", [(0, ""), (1000, "sudo -n env DEBIAN_FRONTEND=noninteractive apt-get")])
def test_a_missing_redis_server_is_installed_update_first_without_a_prompt(tmp_path, uid, prefix):
    rc, err, calls = _run(tmp_path, uid=uid)
    assert rc == 0, err
    apt = [c for c in calls if c.startswith("apt-get")]
    assert [c.split()[1] for c in apt] == ["update", "install"], calls
    assert all(c.endswith("DEBIAN_FRONTEND=noninteractive") for c in apt), calls
    assert "-y" in apt[1].split() and "redis-server" in apt[1].split()
    assert [c for c in calls if c.startswith("sudo")] == ([] if uid == 0 else [f"{prefix} update -qq",
                                                                                f"{prefix} install -y -qq "
                                                                                "--no-install-recommends redis-server"])
    assert (tmp_path / "bin" / "redis-server").exists()


def test_an_installed_redis_server_is_left_alone(tmp_path):
    rc, err, calls = _run(tmp_path, redis=True)
    assert rc == 0 and calls == [], (err, calls)


@pytest.mark.parametrize("case, env, sudo, uid, msg", [
    ("apt-get fails", {"APT_RC": "100"}, True, 0, ""),
    ("installed nothing", {"APT_BROKEN": "1"}, True, 0, "apt-get installed no redis-server"),
    ("not root, no sudo", {}, False, 1000, "needs root (no sudo)"),
])
def test_a_failed_install_fails_loudly(tmp_path, case, env, sudo, uid, msg):
    rc, err, _ = _run(tmp_path, uid=uid, sudo=sudo, **env)
    assert rc != 0 and msg in err, (rc, err)


@pytest.mark.parametrize("ci, outcome", [("true", "Failed"), ("1", "Failed"), ("yes", "Failed"), ("", "Skipped")])
def test_a_missing_redis_server_fails_the_shared_state_tests_under_ci(tmp_path, ci, outcome):
    """ccpo_jax/testing/redis_server.py: without redis-server, CI=true/1/yes (tests.helpers' IN_CI) is a failure, else a
    skip (before: only CI=true failed; CI=1 skipped the shared-state tests silently)."""
    import sys

    code = ("from ccpo_jax.testing import redis_server\n"
            "try:\n    redis_server.redis_binary()\nexcept BaseException as e:\n    print(type(e).__name__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PATH": str(tmp_path), "CI": ci})
    assert r.stdout.strip() == outcome, r.stdout + r.stderr
