"""Generated protobuf and gRPC stubs: edit proto/ and run scripts/gen_proto.py, never these files."""
