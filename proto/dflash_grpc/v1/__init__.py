"""Generated protobuf / gRPC stubs of the dflash-grpc v1 contract (see ``*.proto`` here).

Regenerate with ``python tools/gen_stubs.py``; ``tests/test_proto_stubs.py`` checks they are current.
"""
