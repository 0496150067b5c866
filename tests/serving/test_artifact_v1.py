"""Format-version-1 router artefacts (exported before the ladder's rung-price features, format version 2;
docs/export.md "Format versions") still load and decide as they did at export time. The fixtures in
tests/fixtures/router_v1/ were written by commit 9ed738d's code (tests/fixtures/make_router_v1.py): a
ladder (base and guide) and a one-model router, with the decisions each gave on every round prefix of
12 questions."""
from __future__ import annotations

import json
import shutil

import pytest

from ccpo_jax.serving import ArtifactError, Router
from ccpo_jax.serving.artifact import manifest_checksum
from tests.helpers import REPO

FIXTURES = REPO / "tests" / "fixtures" / "router_v1"


@pytest.mark.parametrize("name", ["ladder", "one-model"])
def test_version_1_artifact_decides_as_at_export(name):
    router = Router.load(FIXTURES / name)
    assert router.manifest["format_version"] == 1
    assert router.F == router.T + 15 and router.ladder == ()  # no rung features, as trained
    rows = json.loads((FIXTURES / f"{name}.requests.json").read_text())
    assert len(rows) == 48 and len({tuple(r["action_set"]) for r in rows}) >= 3  # the sets vary
    got = router.decide_many([r["request"] for r in rows])
    assert [d["action_set"] for d in got] == [r["action_set"] for r in rows]
    assert [d["probs"] for d in got] == [r["probs"] for r in rows]  # bit for bit (float32 through JSON)


def test_version_1_ladder_relabelled_2_is_refused(tmp_path):
    """A version-1 ladder manifest claiming version 2 (checksum recomputed) names the feature mismatch."""
    art = tmp_path / "art"
    shutil.copytree(FIXTURES / "ladder", art)
    man = json.loads((art / "manifest.json").read_text())
    man["format_version"] = 2
    man["manifest_sha256"] = manifest_checksum(man)
    (art / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ArtifactError, match=r"features.names do not match .*feature_names\(4, \('base', 'guide'\)\)"):
        Router.load(art)


def test_version_1_route_cli(tmp_path):
    """``ccpo-jax route`` on a version-1 ladder artefact: the recorded decisions, exit 0."""
    from tests.helpers import run_cli

    rows = json.loads((FIXTURES / "ladder.requests.json").read_text())
    last = [r for r in rows if not r["request"]["can_continue"]]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"q{i}", "rounds": r["request"]["rounds"]}) + "\n"
                           for i, r in enumerate(last)))
    res = run_cli(["route", str(FIXTURES / "ladder"), "--input", str(inp), "--out", str(tmp_path / "out.jsonl")])
    assert res.returncode == 0, res.stderr
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["action_set"] for o in out] == [r["action_set"] for r in last]
