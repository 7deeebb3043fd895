"""Misbehaving plugins (issue 14): each fault is caught at the plugin boundary, reported once
(a warning and a ``graphcap info`` row), and is an error only for the selected backend."""

from __future__ import annotations

import json
import re
import textwrap
import warnings

import plugin_dists
import pytest
from plugin_dists import backend_source, install_plugin
from rollout_models import prompts, tiny_model

import graphcap
from graphcap import cli, registry
from graphcap.errors import BackendSelectionError, PluginError
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams

plugin_dir = plugin_dists.plugin_dir

#: A backend above cpu whose availability(), constructor or create_graph() misbehaves.
FAULTY = """
from graphcap import Availability, Backend, hookimpl

CALLS = []

class BadBackend(Backend):
    name = "bad"
    priority = 1000
    device_type = {device!r}

    @classmethod
    def availability(cls):
        {availability}

    def __init__(self, index=None):
        {init}
        super().__init__(index)

    def create_graph(self):
        {create_graph}

    def current_device_index(self):
        {current_device_index}

@hookimpl
def graphcap_api_version():
    return 1

@hookimpl
def graphcap_backends():
    return {backends}

@hookimpl
def graphcap_attention_implementations(backend):
    CALLS.append(backend.name)
    {attention}
"""

FAULTS = {
    "availability raises": dict(availability="raise RuntimeError('probe exploded')"),
    "availability returns a bool": dict(availability="return True"),
    "constructor raises": dict(init="raise OSError('driver failed to initialise')"),
    "create_graph raises": dict(create_graph="raise RuntimeError('no graph for you')"),
    "device index raises": dict(
        device="xpu", current_device_index="raise RuntimeError('no device context')"
    ),
}
REASONS = {
    "availability raises": r"BadBackend\.availability\(\) raised RuntimeError: probe exploded",
    "availability returns a bool": r"availability\(\) returned bool True, not graphcap\.Avail",
    "constructor raises": r"BadBackend\(\) raised OSError: driver failed to initialise",
    "create_graph raises": r"create_graph\(\) raised RuntimeError: no graph for you",
    "device index raises": r"BadBackend\.device raised RuntimeError: no device context",
}


def faulty_source(device: str = "cpu", backends: str = "[BadBackend]", **body: str) -> str:
    parts = {
        "availability": "return Availability(True, 'ok')",
        "init": "pass",
        "create_graph": "return None",
        "current_device_index": "return 0",
        "attention": "return {}",
        **body,
    }
    return FAULTY.format(device=device, backends=backends, **parts)


def broken_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "is broken and was skipped" in str(w.message)]


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_is_reported_once_and_the_next_backend_is_chosen(
    plugin_dir, monkeypatch, capsys, fault
):
    monkeypatch.setattr(registry, "visible_accelerator", lambda: None)
    install_plugin(plugin_dir, "fake-bad", "fake_bad", faulty_source(**FAULTS[fault]))
    registry.discover(refresh=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert graphcap.get_backend().name == "cpu"  # default selection moves on
        assert cli.main(["info"]) == 0
        table = capsys.readouterr().out
        assert cli.main(["info", "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        with pytest.raises(BackendSelectionError) as err:
            graphcap.get_backend("bad")
    reported = broken_warnings(caught)
    assert len(reported) == 1, reported
    assert reported[0].startswith("graphcap plugin 'fake_bad' from fake-bad is broken")
    assert "* selected: cpu" in table
    assert "broken plugin 'fake_bad' (fake-bad): " in table
    assert [f["entry_point"] for f in info["broken_plugins"]] == ["fake_bad"]
    assert info["broken_plugins"][0]["backends"] == ["bad"]
    assert re.search(REASONS[fault], info["broken_plugins"][0]["error"])
    assert "bad" not in [row["name"] for row in info["backends"]]
    # Selected by name, the fault is the error, naming plugin and distribution.
    assert "its plugin 'fake_bad' from fake-bad is broken" in str(err.value)
    assert re.search(REASONS[fault], str(err.value))


@pytest.mark.parametrize("fault", list(FAULTS))
def test_selected_by_name_first_the_fault_is_the_error(plugin_dir, fault):
    install_plugin(plugin_dir, "fake-bad", "fake_bad", faulty_source(**FAULTS[fault]))
    registry.discover(refresh=True)
    with (
        pytest.warns(UserWarning, match="'fake_bad' from fake-bad is broken"),
        pytest.raises(BackendSelectionError, match=REASONS[fault]) as err,
    ):
        graphcap.get_backend("bad")
    assert "plugin 'fake_bad' from fake-bad" in str(err.value)
    assert graphcap.get_backend("cpu").name == "cpu"


def test_broken_accelerator_plugin_is_not_called_missing(plugin_dir, monkeypatch):
    monkeypatch.setattr(registry, "visible_accelerator", lambda: "xpu")
    source = faulty_source(device="xpu", init="raise OSError('driver failed to initialise')")
    install_plugin(plugin_dir, "fake-bad", "fake_bad", source)
    registry.discover(refresh=True)
    with pytest.warns(UserWarning, match="is broken"), pytest.raises(BackendSelectionError) as err:
        graphcap.get_backend()
    message = str(err.value)
    assert "the backend that claims it (bad, plugin 'fake_bad' from fake-bad) is broken" in message
    assert "driver failed to initialise" in message and "GRAPHCAP_BACKEND=cpu" in message


@pytest.mark.parametrize(
    "backends",
    ["'cpu'", "[object]", "[BadBackend, 'x']", "BadBackend", "[Dup]"],
    ids=["string", "not-a-backend", "mixed", "bare-class", "duplicate-name"],
)
def test_plugin_with_garbage_backends_is_unregistered(plugin_dir, backends):
    source = faulty_source(backends=backends) + textwrap.dedent(
        """
        class Dup(Backend):
            name = "CPU"
        """
    )
    install_plugin(plugin_dir, "fake-bad", "fake_bad", source)
    with pytest.warns(UserWarning, match="'fake_bad' from fake-bad is broken"):
        reg = registry.discover(refresh=True)
    assert "bad" not in reg.backends and reg.backends["cpu"].distribution == "graphcap"
    assert reg.plugin_manager.get_plugin("fake_bad") is None
    registry.attention_implementations(graphcap.get_backend("cpu"))
    import fake_bad

    assert fake_bad.CALLS == []  # its other hooks never run


def test_unselected_plugin_with_a_raising_attention_hook_cannot_break_a_rollout(plugin_dir):
    source = faulty_source(attention="raise RuntimeError('attention hook exploded')")
    install_plugin(plugin_dir, "fake-bad", "fake_bad", source)
    registry.discover(refresh=True)
    model = tiny_model("llama")
    ids, mask = prompts(2)
    with pytest.warns(UserWarning, match="fake-bad is broken.*attention hook exploded"):
        engine = RolloutEngine(model, RolloutConfig(backend="cpu"))
    result = engine.generate(ids, mask, SamplingParams(max_new_tokens=3))
    assert result.sequences.shape[1] == ids.shape[1] + 3
    reg = registry.discover()
    assert reg.plugin_manager.get_plugin("fake_bad") is None and "bad" not in reg.backends
    import fake_bad

    assert fake_bad.CALLS == ["cpu"]  # called once, then unregistered
    RolloutEngine(model, RolloutConfig(backend="cpu"))
    assert fake_bad.CALLS == ["cpu"]


@pytest.mark.parametrize(
    "attention", ["raise RuntimeError('attention hook exploded')", "return ['not', 'a', 'dict']"]
)
def test_selected_plugin_with_a_bad_attention_hook_is_a_clear_error(plugin_dir, attention):
    install_plugin(plugin_dir, "fake-bad", "fake_bad", faulty_source(attention=attention))
    registry.discover(refresh=True)
    with pytest.raises(PluginError, match="plugin 'fake_bad' from fake-bad, which provides the"):
        RolloutEngine(tiny_model("llama"), RolloutConfig(backend="bad"))


@pytest.mark.parametrize("spelling", ["CPU", " cpu", "Cpu "])
def test_backend_names_ignore_case_and_spaces(plugin_dir, monkeypatch, spelling):
    registry.discover(refresh=True)
    assert graphcap.get_backend(spelling).name == "cpu"
    monkeypatch.setenv(registry.ENV_VAR, spelling)
    assert graphcap.get_backend() is graphcap.get_backend("cpu")


def test_unknown_backend_name_suggests_the_close_match(plugin_dir, monkeypatch):
    install_plugin(plugin_dir, "fake-accel", "fake_accel", backend_source("fakeaccel", 1))
    registry.discover(refresh=True)
    monkeypatch.setenv(registry.ENV_VAR, "fakeacel")
    with pytest.raises(BackendSelectionError) as err:
        graphcap.get_backend()
    message = str(err.value)
    assert "'fakeacel' cannot be used: no installed plugin provides it." in message
    assert "Did you mean 'fakeaccel'?" in message
    assert "- cpu (graphcap): available" in message
    assert "- fakeaccel (fake-accel): available" in message


def test_second_plugin_with_a_taken_entry_point_name_is_skipped(plugin_dir):
    install_plugin(plugin_dir, "fake-one", "fake_one", backend_source("one", 1), ep_name="same")
    install_plugin(plugin_dir, "fake-two", "fake_two", backend_source("two", 1), ep_name="same")
    with pytest.warns(UserWarning, match="entry point name 'same' is already used by fake-"):
        reg = registry.discover(refresh=True)
    assert len([n for n in ("one", "two") if n in reg.backends]) == 1
    assert reg.plugin_manager.get_plugin("same") is not None
