"""dflash-grpc wire contract (``dflash_grpc.v1``) and the small runtime helpers that go with it."""
