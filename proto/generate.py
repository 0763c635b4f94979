"""Regenerate the committed protobuf/gRPC Python from the .proto sources.

    python -m tokenbudget.proto.generate            # rewrite proto/*_pb2*.py
    python -m tokenbudget.proto.generate --out DIR  # write elsewhere (staleness test)

Each source is compiled under a virtual path named after its package
(``tokenbudget/v1/`` for ours, ``sglang/grpc/scheduler/`` for the SGLang
gateway's worker protocol) so their descriptors do not clash with other
packages' files of the same name in the global pool; the generated
``from <virtual path> import ...`` lines are then pointed at
``tokenbudget.proto``, where the modules live.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
# Virtual folder (the proto package as a path) -> the sources compiled under it.
SOURCES = {
    "tokenbudget/v1": ("common.proto", "worker.proto", "generate.proto", "kv_bootstrap.proto"),
    "sglang/grpc/scheduler": ("sglang_scheduler.proto",),
}


def generate(out_dir: Path) -> list[Path]:
    """Compile SOURCES into ``out_dir``; returns the files written."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for virtual_dir, sources in SOURCES.items():
        with tempfile.TemporaryDirectory() as tmp:
            args = [
                "grpc_tools.protoc",
                f"-I{virtual_dir}={PROTO_DIR}",
                f"-I{well_known}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                *(f"{virtual_dir}/{s}" for s in sources),
            ]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed: {' '.join(args)}")
            package = virtual_dir.replace("/", ".")
            for path in sorted((Path(tmp) / virtual_dir).iterdir()):
                text = path.read_text().replace(
                    f"from {package} import", "from tokenbudget.proto import"
                )
                target = out_dir / path.name
                target.write_text(text)
                written.append(target)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=PROTO_DIR,
        help="output folder (default: the proto package itself)",
    )
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
