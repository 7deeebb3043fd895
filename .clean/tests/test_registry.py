"""Plugin discovery and backend selection, with real throwaway plugin distributions."""

from __future__ import annotations

import textwrap
from pathlib import Path

import plugin_dists
import pytest
from plugin_dists import backend_source, install_plugin

import graphcap
from graphcap import registry
from graphcap.errors import BackendSelectionError

plugin_dir = plugin_dists.plugin_dir


def test_cpu_backend_is_built_in_and_selected_without_plugins(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    monkeypatch.setattr(registry, "visible_accelerator", lambda: None)
    reg = registry.discover(refresh=True)
    assert reg.backends["cpu"].distribution == "graphcap"
    monkeypatch.setenv(registry.ENV_VAR, "cpu")
    backend = graphcap.get_backend()
    assert backend.name == "cpu"
    assert backend.supports_graph_capture
    assert backend.capabilities.graph_capture


def test_entry_point_plugin_is_discovered_and_wins_by_priority(plugin_dir, monkeypatch):
    install_plugin(plugin_dir, "fake-accel", "fake_accel", backend_source("fakeaccel", 1000))
    reg = registry.discover(refresh=True)
    record = reg.backends["fakeaccel"]
    assert (record.distribution, record.version) == ("fake-accel", "0.3")
    backend = graphcap.get_backend()
    assert backend.name == "fakeaccel"
    assert backend.distribution == "fake-accel"
    # The environment variable overrides priority.
    monkeypatch.setenv(registry.ENV_VAR, "cpu")
    assert graphcap.get_backend().name == "cpu"


def test_unavailable_backend_is_skipped_by_auto_and_refused_by_name(plugin_dir, monkeypatch):
    monkeypatch.setattr(registry, "visible_accelerator", lambda: None)
    install_plugin(
        plugin_dir,
        "fake-gone",
        "fake_gone",
        backend_source("gone", 2000, available=False, reason="no gone device visible"),
    )
    registry.discover(refresh=True)
    assert graphcap.get_backend().name != "gone"
    with pytest.raises(BackendSelectionError) as err:
        graphcap.get_backend("gone")
    message = str(err.value)
    assert "unavailable here: no gone device visible" in message
    assert "- cpu (graphcap): available" in message


def test_unknown_backend_error_lists_installed_backends(plugin_dir, monkeypatch):
    registry.discover(refresh=True)
    monkeypatch.setenv(registry.ENV_VAR, "nosuch")
    with pytest.raises(BackendSelectionError) as err:
        graphcap.get_backend()
    assert "'nosuch'" in str(err.value)
    assert "no installed plugin provides it" in str(err.value)
    assert "- cpu (graphcap): available" in str(err.value)


def test_missing_known_plugin_says_how_to_install(plugin_dir):
    registry.discover(refresh=True)
    if "cuda" in registry.discover().backends:
        pytest.skip("graphcap-cuda is installed in this environment")
    with pytest.raises(BackendSelectionError, match=r"install graphcap-cuda"):
        graphcap.get_backend("cuda")


@pytest.mark.parametrize("device", sorted(registry.PLUGIN_HINTS))
def test_install_hint_names_a_plugin_directory_of_this_repository(device):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    hint = registry.PLUGIN_HINTS[device]
    distribution, command = hint.split(" ", 1)[0], hint.split("pip install ", 1)[1].rstrip(")")
    project = Path(__file__).resolve().parents[1] / command / "pyproject.toml"  # the repository
    assert tomllib.loads(project.read_text())["project"]["name"] == distribution


@pytest.mark.parametrize(
    "body, error",
    [
        ("raise ImportError('libfake.so: cannot open shared object file')", "ImportError"),
        ("import sys\nsys.exit(3)", "SystemExit"),
    ],
)
def test_broken_plugin_is_reported_and_does_not_break_others(plugin_dir, body, error):
    install_plugin(plugin_dir, "fake-broken", "fake_broken", body, ep_name="broken")
    install_plugin(plugin_dir, "fake-good", "fake_good", backend_source("good", 1000))
    with pytest.warns(UserWarning, match=rf"'broken' from fake-broken is broken.*{error}"):
        reg = registry.discover(refresh=True)
    assert "good" in reg.backends
    assert graphcap.get_backend().name == "good"
    with pytest.raises(
        BackendSelectionError, match=rf"broken: import of 'fake_broken' raised {error}"
    ):
        graphcap.get_backend("broken")


def test_plugin_for_another_api_version_is_refused(plugin_dir):
    install_plugin(plugin_dir, "fake-future", "fake_future", backend_source("future", api=99))
    with pytest.warns(UserWarning, match="plugin API version 99.*supports version"):
        reg = registry.discover(refresh=True)
    assert "future" not in reg.backends
    with pytest.raises(BackendSelectionError, match="written for graphcap plugin API version 99"):
        graphcap.get_backend("future")


def test_duplicate_backend_name_keeps_first_and_warns(plugin_dir):
    install_plugin(plugin_dir, "fake-dup", "fake_dup", backend_source("cpu", 5000))
    with pytest.warns(UserWarning, match="offered by both graphcap and fake-dup"):
        reg = registry.discover(refresh=True)
    assert reg.backends["cpu"].distribution == "graphcap"


def test_unclaimed_accelerator_is_not_silently_run_on_cpu(plugin_dir, monkeypatch):
    monkeypatch.setattr(registry, "visible_accelerator", lambda: "xpu")
    registry.discover(refresh=True)
    with pytest.raises(
        BackendSelectionError, match=r"sees a 'xpu' accelerator.*GRAPHCAP_BACKEND=cpu"
    ):
        graphcap.get_backend()
    monkeypatch.setenv(registry.ENV_VAR, "cpu")
    assert graphcap.get_backend().name == "cpu"


def test_attention_implementations_hook_is_called_for_the_backend(plugin_dir):
    source = backend_source("attn", 1) + textwrap.dedent(
        """
        def fake_attention(*args, **kwargs):
            return None

        @hookimpl
        def graphcap_attention_implementations(backend):
            return {"fake_attn_" + backend.name: fake_attention}
        """
    )
    install_plugin(plugin_dir, "fake-attn", "fake_attn", source)
    registry.discover(refresh=True)
    impls = registry.attention_implementations(graphcap.get_backend("cpu"))
    assert list(impls) == ["fake_attn_cpu"]


def test_offered_attention_is_registered_with_its_mask_function(plugin_dir):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    source = backend_source("attn2", 1) + textwrap.dedent(
        """
        def fake_attention(*args, **kwargs):
            return None

        @hookimpl
        def graphcap_attention_implementations(backend):
            return {"graphcap_test_attn": fake_attention}
        """
    )
    install_plugin(plugin_dir, "fake-attn2", "fake_attn2", source)
    registry.discover(refresh=True)
    names = registry.register_attention_implementations(graphcap.get_backend("cpu"))
    assert names == ["graphcap_test_attn"]
    assert AttentionInterface()["graphcap_test_attn"].__name__ == "fake_attention"
    assert AttentionMaskInterface()["graphcap_test_attn"] is sdpa_mask


def test_core_never_names_a_device_library():
    root = Path(graphcap.__file__).parent
    pattern = ("torch." + "cuda", "torch." + "npu", "torch" + "_npu")
    offenders = [
        f"{path.relative_to(root.parent)}:{number}: {line.strip()}"
        for path in root.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if any(word in line for word in pattern)
    ]
    assert not offenders, "graphcap/ must stay device-agnostic:\n" + "\n".join(offenders)
