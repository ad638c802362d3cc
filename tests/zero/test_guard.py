"""The DeepSpeed version guard: the tested range is enforced, and what is outside it is said."""

from __future__ import annotations

import pytest

from ds_nvfp4.zero import guard


@pytest.mark.parametrize(("version", "ok"), [("0.19.8", True), ("0.19.12", True), ("0.19.8+cpu", True),
                                             ("0.19.7", False), ("0.20.0", False), ("0.18.5", False),
                                             ("1.0.0", False)])
def test_version_outside_the_tested_range_is_refused_unless_allowed(monkeypatch, version: str, ok: bool) -> None:
    monkeypatch.setattr(guard, "deepspeed_version", lambda: version)
    if ok:
        assert guard.check_version() is None
        return
    with pytest.raises(guard.UnsupportedDeepSpeed, match=rf"DeepSpeed {version.split('+')[0]} is outside.*"
                                                         "DS_NVFP4_ALLOW_UNTESTED_DEEPSPEED=1"):
        guard.check_version()
    assert "outside the range" in guard.check_version(allow_untested=True)


def test_the_installed_deepspeed_is_in_the_tested_range() -> None:
    """CI installs what pyproject allows: the guard must accept it (else every packed run would refuse)."""
    assert guard.check_version() is None, guard.deepspeed_version()


def test_missing_private_names_are_listed_with_the_version() -> None:
    class Opt:
        fp16_groups = ()

    with pytest.raises(guard.UnsupportedDeepSpeed, match=r"lacks .*optimizer\.fp32_partitioned_groups_flat"):
        guard.check_engine(Opt(), [])
