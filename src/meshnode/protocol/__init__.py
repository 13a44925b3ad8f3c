"""meshnode.protocol: wire messages (msgpack + raw tensor bytes), DHT keys and record schemas (validated,
signed), the stage servicer and its size limits. Imports hivemind's p2p/dht pieces, no daemon logic."""

from .keys import (
    dp_prefix,
    load_or_create_identity,
    owner_of,
    owner_tag,
    peers_key,
    prior_data_key,
    prior_key,
    public_key_string,
)
from .limits import Limits
from .messages import MicrobatchRequest, WireError
from .records import PeerRecord, make_schema_validator, parse_peers
from .servicer import RPCContext, RPCError, StageServicer, call_rpc, stream_rpc

__all__ = [
    "Limits", "MicrobatchRequest", "PeerRecord", "RPCContext", "RPCError", "StageServicer", "WireError", "call_rpc",
    "dp_prefix", "load_or_create_identity", "make_schema_validator", "owner_of", "owner_tag", "parse_peers",
    "peers_key", "prior_data_key", "prior_key", "public_key_string", "stream_rpc",
]
