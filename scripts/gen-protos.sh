#!/usr/bin/env bash
# Regenerate the Python stubs in services/protos/ from protos/*.proto.
# The generated files are committed; pyproject pins grpcio-tools and protobuf together, so run
# this with those versions (the project's venv) after changing a .proto.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
out=services/protos
rm -f "$out"/*_pb2.py "$out"/*_pb2_grpc.py "$out"/*_pb2.pyi
"$PY" -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" protos/*.proto
# protoc writes top-level imports ("import kv_pb2"); make them package-relative.
for f in "$out"/*_pb2.py "$out"/*_pb2_grpc.py "$out"/*_pb2.pyi; do
  sed -i -E 's/^import ([A-Za-z0-9_]+_pb2) as /from . import \1 as /' "$f"
done
echo "generated $(ls "$out"/*_pb2*.py | wc -l) files in $out"
