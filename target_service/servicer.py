"""gRPC servicer of the target service: a thin map from the v1 contract onto :class:`TargetEngine`.

Errors: an engine error in a unary call aborts it with the error's status; inside a Verify
stream message, each item gets its own ``ItemStatus`` so one bad item touches no other session.
"""

from __future__ import annotations

import logging

import grpc
import torch

from dflash_grpc.v1 import common_pb2, target_pb2, target_pb2_grpc
from dflash_grpc.wire import tensor_to_proto
from target_service.engine import EngineError, InvalidArgument, Sampling, TargetEngine

log = logging.getLogger(__name__)

FEATURES = ["tree-verify", "sampling", "features-bf16", "chunked-prefill"]


def _features_proto(t: torch.Tensor | None) -> common_pb2.Tensor | None:
    return tensor_to_proto(t, torch.bfloat16) if t is not None else None


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    """Implements ``dflash_grpc.v1.TargetService`` over one :class:`TargetEngine`."""

    def __init__(self, engine: TargetEngine, info: common_pb2.ModelInfo):
        self.engine = engine
        self.info = info

    def Info(self, request, context):
        return self.info

    def Prefill(self, request, context):
        results = []
        opened: list[str] = []
        try:
            for item in request.items:
                s = item.sampling
                sampling = Sampling.checked(s.temperature, s.top_k, s.top_p, s.seed if s.HasField("seed") else None)
                out = self.engine.prefill(item.session_id, list(item.prompt_tokens), sampling, list(item.feature_layer_ids))
                opened.append(item.session_id)
                results.append(
                    target_pb2.PrefillResult(
                        session_id=item.session_id,
                        first_token=out.first_token,
                        committed_length=out.committed_length,
                        features=_features_proto(out.features),
                    )
                )
        except EngineError as e:
            # All-or-nothing: undo the items of this call that did open.
            self.engine.release(opened)
            context.abort(e.code, str(e))
        return target_pb2.PrefillResponse(results=results)

    def Verify(self, request_iterator, context):
        for request in request_iterator:
            results = []
            for item in request.items:
                try:
                    if not item.HasField("tree"):
                        raise InvalidArgument("item has no tree")
                    out = self.engine.verify(item.session_id, list(item.tree.tokens), list(item.tree.parents))
                    results.append(
                        target_pb2.VerifyResult(
                            session_id=item.session_id,
                            status=common_pb2.ItemStatus(code=0),
                            accepted_tokens=out.accepted_tokens,
                            accepted_nodes=out.accepted_nodes,
                            bonus_token=out.bonus_token,
                            committed_length=out.committed_length,
                            features=_features_proto(out.features),
                        )
                    )
                except EngineError as e:
                    results.append(
                        target_pb2.VerifyResult(
                            session_id=item.session_id,
                            status=common_pb2.ItemStatus(code=e.code.value[0], message=str(e)),
                        )
                    )
            yield target_pb2.VerifyResponse(results=results)

    def Release(self, request, context):
        return common_pb2.ReleaseResponse(released=self.engine.release(list(request.session_ids)))
