"""Generated gRPC/protobuf modules for protos/*.proto (regenerate with scripts/gen-protos.sh)."""
