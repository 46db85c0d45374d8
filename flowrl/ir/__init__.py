"""The graph IR: nodes, declarations, verification and printing."""

from flowrl.ir.graph import (
    CONTROLLER,
    DataDecl,
    EvalDecl,
    Graph,
    GroupDecl,
    ModelDecl,
    Node,
    PassRecord,
    PoolDecl,
    Range,
    Ref,
    RewardDecl,
)
from flowrl.ir.printer import to_json, to_json_text, to_text
from flowrl.ir.verify import GraphError, verify

__all__ = [
    "CONTROLLER", "DataDecl", "EvalDecl", "Graph", "GraphError", "ModelDecl", "Node", "PassRecord", "PoolDecl", "Range",
    "Ref", "RewardDecl", "GroupDecl", "to_json", "to_json_text", "to_text", "verify",
]
