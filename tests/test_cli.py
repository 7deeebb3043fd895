"""`graphcap info`: the installed backends as a table and as JSON, and a failed selection."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from graphcap import cli, registry


def test_info_table_marks_the_selected_backend(monkeypatch, capsys):
    monkeypatch.setenv(registry.ENV_VAR, "cpu")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    header, *rows = out.splitlines()
    assert header.split()[:3] == ["backend", "distribution", "available"]
    cpu_row = next(r for r in rows if r.split()[1:2] == ["cpu"])
    assert cpu_row.startswith("*") and "graph_capture" in cpu_row and "mask=additive" in cpu_row
    assert "* selected: cpu" in out


def test_info_json_lists_capabilities_and_selection(monkeypatch, capsys):
    monkeypatch.setenv(registry.ENV_VAR, "cpu")
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["selected"] == "cpu" and info["selection_error"] is None
    cpu = next(b for b in info["backends"] if b["name"] == "cpu")
    assert cpu["capabilities"]["graph_capture"] is True and cpu["selected"] is True


def test_info_explains_a_selection_that_fails(monkeypatch, capsys):
    monkeypatch.setenv(registry.ENV_VAR, "nosuch")
    assert cli.main(["info"]) == 1
    out = capsys.readouterr().out
    assert "no backend selected: graphcap backend 'nosuch' cannot be used" in out


def test_info_and_help_do_not_import_the_bench_or_dynamo():
    # The bench (torch._dynamo, transformers' generation stack) is imported only when it runs.
    code = (
        "import sys, contextlib, io\n"
        "from graphcap import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    cli.main(['info'])\n"
        "    with contextlib.suppress(SystemExit):\n"
        "        cli.main(['--help'])\n"
        "lazy = ('graphcap.bench', 'torch._dynamo')\n"
        "print(sorted(m for m in sys.modules if m.startswith(lazy)))\n"
    )
    env = {**os.environ, registry.ENV_VAR: "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_importing_the_rollout_engine_leaves_transformers_models_unloaded():
    # transformers.modeling_utils costs seconds; a model's own module loads it where one is built
    code = "import sys, graphcap.rollout\nprint('transformers.modeling_utils' in sys.modules)\n"
    env = {**os.environ, registry.ENV_VAR: "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_bench_subcommand_parses_its_own_options(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    assert "--batch-sizes" in capsys.readouterr().out
    assert cli.main(["bench", "--model", "no-such-model", "--quiet"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["info", "--batch-sizes", "1"])
