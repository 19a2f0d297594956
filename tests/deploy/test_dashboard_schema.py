"""The Grafana dashboard type-checks against Grafana's own schema (npm ``@grafana/schema`` + ``tsc``, through
docker/grafana/validate/check.mjs), and the check catches a wrong type and an unknown key."""
from __future__ import annotations

import json
import subprocess

import pytest

from helpers import DASHBOARDS, DOCKER
from serving import require

VALIDATE = DOCKER / "grafana" / "validate"
pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def check():
    npm, node = require("npm"), require("node")
    if not (VALIDATE / "node_modules" / "@grafana" / "schema").is_dir():
        r = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=VALIDATE,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr

    def run(*files):
        return subprocess.run([node, "check.mjs", *map(str, files)], cwd=VALIDATE, capture_output=True, text=True,
                              timeout=120)
    return run


def test_the_dashboards_match_grafanas_schema(check):
    r = check(*DASHBOARDS)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 error(s)" in r.stdout


def test_the_check_catches_a_wrong_type_and_an_unknown_key(check, tmp_path):
    dash = json.loads(DASHBOARDS[0].read_text())
    dash["panels"][0]["gridPos"]["h"] = "eight"          # a number in the schema
    dash["panels"][1]["options"]["legend"]["colour"] = 1  # no such key
    dash["refresh"] = 10                                  # a string
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dash, indent=2))
    r = check(bad)
    assert r.returncode == 1
    assert "3 error(s)" in r.stdout, r.stdout + r.stderr  # one per literal: the dashboard, panels 1 and 2
    err = r.stderr
    assert f"{bad}: dashboard: Type 'number' is not assignable to type 'string'" in err, err
    assert f'{bad}: panel 1 ("{dash["panels"][0]["title"]}")' in err and "'string' is not assignable" in err, err
    assert 'panel 2' in err and "'\"colour\"' does not exist" in err, err
