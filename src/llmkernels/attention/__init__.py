"""FA4-style attention forward (the seed's SM100MHA2Q rebuilt in Triton).

* :func:`attention`: dense, ragged (``cu_seqlens_*``) and paged (:class:`PagedKVCache`) layouts; MHA/GQA/MQA;
  causal, :class:`SlidingWindow`, :class:`Chunked`, user ``mask_mod``; :func:`softcap`, :func:`alibi`, user
  ``score_mod``; sinks; split-KV decode; LSE.
* :class:`FA4Config`: tiling and the FA4 switches (two Q tiles, conditional rescale, polynomial exp2).
* :func:`attention_reference`: the float32 PyTorch reference.
"""
from .api import attention
from .config import FA4Config, default_config
from .masks import Chunked, SlidingWindow, alibi, softcap
from .paged import PagedKVCache
from .reference import attention_reference

__all__ = ["attention", "FA4Config", "default_config", "PagedKVCache", "SlidingWindow", "Chunked", "softcap",
           "alibi", "attention_reference"]
