"""Plugin discovery and backend selection, with real throwaway plugin distributions."""

from __future__ import annotations

import textwrap
from pathlib import Path

import plugin_dists
import pytest
import torch
from plugin_dists import backend_source, install_plugin
from rollout_models import prompts, run, tiny_model

import graphcap
from graphcap import registry
from graphcap.backend import OLD_CAPABILITY_NAMES
from graphcap.cpu import CPUBackend
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


def test_the_backend_of_a_device_is_the_named_one_else_the_highest_priority(
    plugin_dir, monkeypatch
):
    """What serves a tensor on a device (trainer_exact's default): the backend
    GRAPHCAP_BACKEND names where it runs there, else the highest-priority one; a device nothing
    runs on is refused naming the installed backends."""
    install_plugin(plugin_dir, "fake-accel", "fake_accel", backend_source("fakeaccel", 1000))
    registry.discover(refresh=True)
    assert registry.backend_for_device("cpu").name == "fakeaccel"  # a CPU plugin, priority 1000
    monkeypatch.setenv(registry.ENV_VAR, "cpu")
    assert registry.backend_for_device("cpu").name == "cpu"
    with pytest.raises(BackendSelectionError, match="no available graphcap backend runs on 'xpu'"):
        registry.backend_for_device("xpu")


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


#: A plugin written for API 1: its backend declares capabilities under their version-1 names.
API_1_PLUGIN = """
from graphcap import hookimpl
from graphcap.cpu import CPUBackend

class LegacyBackend(CPUBackend):
    name = "legacy"
    priority = -30
    captures_graphs = True
    attention_mask_form = "bool"
    compiles_by_default = True
    joins_projections_by_default = True

@hookimpl
def graphcap_api_version():
    return 1

@hookimpl
def graphcap_backends():
    return [LegacyBackend]
"""


def test_plugin_declaring_api_1_capability_names_still_works(plugin_dir):
    """Each version-1 name warns once and is read under its new name: the bool mask and the
    fused projections reach the engine, whose tokens equal the eager loop's."""
    install_plugin(plugin_dir, "fake-legacy", "fake_legacy", API_1_PLUGIN)
    with pytest.warns(DeprecationWarning) as caught:
        registry.discover(refresh=True)
    warned = " ".join(str(w.message) for w in caught if w.category is DeprecationWarning)
    for old, new in OLD_CAPABILITY_NAMES.items():
        assert f"LegacyBackend.{old} is the plugin API 1 name of {new}" in warned
    backend = graphcap.get_backend("legacy")
    assert type(backend).graph_capture is True and type(backend).compile_by_default is True
    caps = backend.capabilities
    assert caps.graph_capture and caps.mask_form == "bool" and caps.fuse_projections_by_default
    with pytest.warns(DeprecationWarning, match="read backend.capabilities.graph_capture"):
        assert backend.supports_graph_capture
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(2)
    expected = run(model, ids, mask, False, max_new_tokens=6, eos_token_id=[])
    result = run(model, ids, mask, True, backend, max_new_tokens=6, eos_token_id=[])
    assert result.stats.path == "static_graph" and result.stats.fused_projections == 4
    assert torch.equal(result.sequences, expected.sequences)


def test_old_and_new_name_of_one_capability_on_one_class_is_an_error():
    with pytest.raises(TypeError, match=r"declares both compiles_by_default .* keep only"):

        class Both(CPUBackend):
            compiles_by_default = True
            compile_by_default = True


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
