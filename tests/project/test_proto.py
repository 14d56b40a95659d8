"""The committed admin API code is exactly what scripts/gen_proto.py generates from proto/."""

from __future__ import annotations

import runpy
from pathlib import Path

from tests.conftest import ROOT


def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    generate = runpy.run_path(str(ROOT / "scripts" / "gen_proto.py"))["generate"]
    written = generate(tmp_path)
    assert {p.name for p in written} >= {"admin_pb2.py", "admin_pb2.pyi", "admin_pb2_grpc.py", "admin_pb2_grpc.pyi"}
    stale = []
    for path in written:
        rel = path.relative_to(tmp_path)
        committed = ROOT / rel
        if not committed.exists() or committed.read_bytes() != path.read_bytes():
            stale.append(str(rel))
    assert stale == [], "run `make proto` and commit the result"


def test_service_has_the_operator_calls() -> None:
    from extproc._proto.admin.v1 import admin_pb2

    methods = {m.name for m in admin_pb2.DESCRIPTOR.services_by_name["Admin"].methods}
    assert methods == {
        "Explain",
        "ListReplicas",
        "GetSession",
        "ForgetSession",
        "Cordon",
        "Uncordon",
        "Drain",
        "WatchDecisions",
        "ListHotKeys",
        "GetUsage",
        "GetHitRatio",
    }
