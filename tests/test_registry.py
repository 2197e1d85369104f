"""The one registry type: names are case-insensitive, unknown names are one error listing the
registered ones, a name is taken once, and built-in modules are imported on the first lookup."""

from __future__ import annotations

import sys

import pytest

from optllm.errors import UserError
from optllm.registry import Registry


def test_lookup_is_case_insensitive_and_unknown_names_list_the_registered_ones():
    reg: Registry[int] = Registry("widget")
    reg.register("Alpha", 1)
    reg.register("beta", 2)
    assert reg.get(" ALPHA ") == 1 and "BETA" in reg and reg.names() == ["alpha", "beta"]
    with pytest.raises(UserError, match=r"^unknown widget 'gamma'; allowed: alpha, beta$"):
        reg.get("gamma")
    with pytest.raises(ValueError, match="widget 'alpha' is already registered"):
        reg.register("alpha", 3)
    reg.register("alpha", 3, replace=True)
    assert reg.get("alpha") == 3
    reg.unregister("alpha")
    assert reg.names() == ["beta"]


def test_builtins_are_imported_on_the_first_lookup(tmp_path, monkeypatch):
    (tmp_path / "registry_builtin_probe.py").write_text(
        "from tests_registry_target import REG\nREG.register('probe', 42)\n")
    (tmp_path / "tests_registry_target.py").write_text(
        "from optllm.registry import Registry\nREG = Registry('probe kind', builtins=('registry_builtin_probe',))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from tests_registry_target import REG

    try:
        assert "registry_builtin_probe" not in sys.modules
        assert REG.get("probe") == 42 and REG.names() == ["probe"]
    finally:
        for m in ("registry_builtin_probe", "tests_registry_target"):
            sys.modules.pop(m, None)
