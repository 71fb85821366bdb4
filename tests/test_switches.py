"""Every VLLM_MMRETRY* on/off switch is read by one rule (`switches`)."""

from __future__ import annotations

import pathlib
import re

import pytest

from vllm_mmretry import catchup, output_processor, prom, receive, switches


@pytest.mark.parametrize("value", ["0", "false", "OFF", "No", " 0 ", "off\n"])
def test_off_spellings(value: str) -> None:
    assert switches.is_off(value)


@pytest.mark.parametrize("value", ["1", "true", "on", "", "2", "disable"])
def test_anything_else_is_on(value: str) -> None:
    assert not switches.is_off(value)


def test_an_unset_switch_takes_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_MMRETRY_TEST_SWITCH", raising=False)
    assert switches.switch_on("VLLM_MMRETRY_TEST_SWITCH")
    assert not switches.switch_on("VLLM_MMRETRY_TEST_SWITCH", default=False)


@pytest.mark.parametrize("value, on", [(" 0", False), ("no", False), ("1", True), ("yes", True)])
def test_the_package_switches_agree(monkeypatch: pytest.MonkeyPatch, value: str, on: bool) -> None:
    monkeypatch.setenv(receive.ENV_SWITCH, value)
    monkeypatch.setenv(receive.DECODE_SWITCH, value)
    monkeypatch.setenv(output_processor.NATIVE_DETOK_ENV, value)
    monkeypatch.setenv(prom.ENV_SWITCH, value)
    monkeypatch.setenv(catchup.ENV_SWITCH, value)
    assert receive.enabled() is on
    assert prom.enabled() is on
    assert catchup.enabled() is on
    assert receive.native_decode_enabled() is on
    assert output_processor.native_detok_enabled() is on
    assert output_processor.native_detok_enabled(not on) is (not on)


def _names_read_by_the_sources() -> set[str]:
    root = pathlib.Path(__file__).resolve().parents[1]
    sources = [*root.joinpath("python", "vllm_mmretry").rglob("*.py"),
               *(p for p in root.joinpath("rust", "src").rglob("*.rs") if p.name != "tests.rs")]
    names = set()
    for path in sources:
        names.update(re.findall(r'"(VLLM_MMRETRY(?:_[A-Z_]+)?)"', path.read_text()))
    return names


def test_every_variable_the_package_reads_is_declared_to_vllm() -> None:
    assert set(switches.PACKAGE_ENVS) == _names_read_by_the_sources()


def test_an_empty_value_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_MMRETRY_TEST_SWITCH", "")
    assert switches.switch_on("VLLM_MMRETRY_TEST_SWITCH", default=False)
