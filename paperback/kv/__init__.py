"""KV cache formats (codecs), named schemes, per-layer policies and the quantized cache."""

from paperback.kv.cache import LayerStore, QuantizedKVCache
from paperback.kv.calibrate import calibrate_kv_amax
from paperback.kv.policy import KVPolicy, build_policy
from paperback.kv.schemes import KVScheme, parse_kv_scheme

__all__ = ["LayerStore", "QuantizedKVCache", "calibrate_kv_amax", "KVPolicy", "build_policy", "KVScheme",
           "parse_kv_scheme"]
