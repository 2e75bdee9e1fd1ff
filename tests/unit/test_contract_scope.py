"""The in-pod contract holds the contract only: names, types and parsers both sides share."""

from __future__ import annotations

from pathlib import Path

CONTRACT = Path(__file__).resolve().parents[2] / "spotguard" / "contract"


def test_the_contract_scans_no_processes() -> None:
    # Which process is the trainer is the uploader's question (spotguard.sidecar.trainerproc).
    scanning = [p.name for p in sorted(CONTRACT.glob("*.py")) if "/proc" in p.read_text(encoding="utf-8")]
    assert scanning == []
