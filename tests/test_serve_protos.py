"""The committed gRPC code in pprun/serve/_proto is what scripts/gen_protos.py makes of protos/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "pprun" / "serve" / "_proto"


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and "__pycache__" not in p.parts}


def test_generated_code_matches_protos(tmp_path):
    out = tmp_path / "gen"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(out)], check=True,
                   capture_output=True)
    fresh, committed = _tree(out), _tree(GENERATED)
    assert sorted(fresh) == sorted(committed), "run python scripts/gen_protos.py: the generated file set differs"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"run python scripts/gen_protos.py: {stale} differ from what protos/ generates"


def test_kserve_messages_match_tritons_field_numbers():
    """Every field of the KServe messages pprun serves has the number and type of Triton's own
    grpc_service.proto (as tritonclient ships it), so the two are one protocol on the wire."""
    code = """
import json
from google.protobuf import descriptor_pb2
from tritonclient.grpc import service_pb2 as triton
def fields(fd_module):
    fd = descriptor_pb2.FileDescriptorProto(); fd_module.DESCRIPTOR.CopyToProto(fd)
    out = {}
    def walk(m, prefix):
        for f in m.field:
            out[f"{prefix}{m.name}.{f.name}"] = [f.number, f.type, f.label, f.type_name]
        for n in m.nested_type:
            walk(n, f"{prefix}{m.name}.")
    for m in fd.message_type:
        walk(m, "")
    methods = {f"{s.name}.{m.name}": [m.input_type, m.output_type, m.client_streaming, m.server_streaming]
               for s in fd.service for m in s.method}
    return {"fields": out, "methods": methods}
print(json.dumps(fields(triton)))
"""
    ours_code = code.replace("from tritonclient.grpc import service_pb2 as triton",
                             "from pprun.serve._proto.inference import grpc_service_pb2 as triton")
    # Two processes: both modules define the same `inference.*` symbols, which one protobuf
    # descriptor pool refuses to hold twice.
    import json

    theirs = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
    ours = json.loads(subprocess.run([sys.executable, "-c", ours_code], check=True, capture_output=True,
                                     text=True).stdout)
    assert ours["fields"] and ours["methods"]
    for name, spec in ours["fields"].items():
        assert theirs["fields"].get(name) == spec, f"{name}: ours {spec}, Triton's {theirs['fields'].get(name)}"
    for name, spec in ours["methods"].items():
        assert theirs["methods"].get(name) == spec, f"{name}: ours {spec}, Triton's {theirs['methods'].get(name)}"
