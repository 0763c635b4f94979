"""Regenerate the committed protobuf/gRPC Python from the .proto sources.

    python -m tokenbudget.proto.generate            # rewrite proto/*_pb2*.py
    python -m tokenbudget.proto.generate --out DIR  # write elsewhere (staleness test)

The sources are compiled under the virtual path ``tokenbudget/v1/`` so their
descriptors do not clash with other packages' ``common.proto`` in the global
pool; the generated ``from tokenbudget.v1 import ...`` lines are then pointed
at ``tokenbudget.proto``, where the modules live.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
SOURCES = ("common.proto", "worker.proto", "generate.proto")
VIRTUAL_DIR = "tokenbudget/v1"


def generate(out_dir: Path) -> list[Path]:
    """Compile SOURCES into ``out_dir``; returns the files written."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{VIRTUAL_DIR}={PROTO_DIR}", f"-I{well_known}",
                f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                *(f"{VIRTUAL_DIR}/{s}" for s in SOURCES)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        for path in sorted((Path(tmp) / VIRTUAL_DIR).iterdir()):
            text = path.read_text().replace("from tokenbudget.v1 import", "from tokenbudget.proto import")
            target = out_dir / path.name
            target.write_text(text)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR,
                        help="output folder (default: the proto package itself)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
