"""What the kvz connector's scheduler side hands its worker side each step, and what it keeps per
request."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["KvzConnectorMetadata", "LoadSpec", "SaveSpec", "RequestState"]


@dataclass
class LoadSpec:
    req_id: str
    segments: list  # [Segment]
    block_ids: list  # the request's block ids (index = block position)


@dataclass
class SaveSpec:
    req_id: str
    token_ids: list
    first_block: int
    block_ids: list  # ids of blocks first_block..first_block+n
    hashes: list


@dataclass
class KvzConnectorMetadata(KVConnectorMetadata):
    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)


@dataclass
class RequestState:
    token_ids: list
    block_ids: list
    prompt_len: int
    hit_blocks: int = 0
    lossy_load: bool = False
    saved: bool = False
