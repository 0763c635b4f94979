"""The wheel holds the whole product: every file of the four package folders
(modules of subpackages too, the .proto sources, the generated stubs and the
py.typed markers); the .proto files compile for other languages as
docs/protos.md says.

(.ci/run goes further: it installs the wheel into a fresh virtual environment
and serves from it.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "core": "tokenbudget/core",
    "worker": "tokenbudget/worker",
    "proto": "tokenbudget/proto",
    "server": "tokenbudget/server",
}


def test_wheel_ships_every_module_proto_stub_and_py_typed_marker(tmp_path):
    # Build from a copy: setuptools writes build/ and *.egg-info beside the sources.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in PACKAGES:
        shutil.copytree(
            ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    # Offline: the build uses this environment's setuptools (the [test] extra pins it).
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("tokenbudget-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(
            zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")
        )

    expected = {
        f"{PACKAGES[folder]}/{path.relative_to(src / folder).as_posix()}"
        for folder in PACKAGES
        for path in (src / folder).rglob("*")
        if path.is_file()
    }
    assert {
        "tokenbudget/core/kv/block_pool.py",
        "tokenbudget/proto/worker.proto",
        "tokenbudget/proto/worker_pb2.pyi",
    } <= expected
    assert {f"{p}/py.typed" for p in PACKAGES.values()} <= expected
    assert sorted(expected - names) == []
    assert "server = tokenbudget.server.entrypoints.cli:main" in entry_points


def test_protos_compile_with_the_protoc_command_docs_protos_md_gives(tmp_path):
    from google.protobuf import descriptor_pb2

    doc = (ROOT / "docs" / "protos.md").read_text()
    assert "protoc -Itokenbudget/v1=proto" in doc
    out = tmp_path / "tokenbudget.pb"
    # sglang_scheduler.proto (the gateway's package) has its own path: see protos.md.
    sources = [
        f"tokenbudget/v1/{p.name}"
        for p in sorted((ROOT / "proto").glob("*.proto"))
        if p.name != "sglang_scheduler.proto"
    ]
    # As documented, with the folder spelled out instead of run from the root.
    args = [
        "protoc",
        f"-Itokenbudget/v1={ROOT / 'proto'}",
        f"--descriptor_set_out={out}",
        "--include_imports",
        *sources,
    ]
    # In a child process: protoc's native library and NIXL's (loaded by the
    # disaggregation tests) abort a process that holds both.
    assert subprocess.run([sys.executable, "-m", "grpc_tools.protoc", *args[1:]]).returncode == 0
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    services = {f"{f.package}.{s.name}" for f in files for s in f.service}
    assert {"tokenbudget.v1.Generation", "tokenbudget.v1.Worker"} <= services
