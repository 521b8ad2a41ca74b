"""FA4-style attention forward (the seed's SM100MHA2Q rebuilt in Triton).

* :func:`attention`: dense, ragged (``cu_seqlens_*``) and paged (:class:`PagedKVCache`) layouts; MHA/GQA/MQA;
  causal, :class:`SlidingWindow`, :class:`Chunked`, user ``mask_mod``; :func:`softcap`, :func:`alibi`, user
  ``score_mod``; sinks; split-KV decode; LSE.
* :class:`FA4Config`: tiling and the FA4 switches (two Q tiles, conditional rescale, polynomial exp2).
* :func:`attention_reference`: the float32 PyTorch reference.

A call runs check → plan → launch: ``check`` validates once per call signature (:class:`check.CheckedCall`);
``plan`` keeps a plan per signature, which asks its backends in order (``gluon_hopper``: the Gluon prefill,
``gluon_decode``: the Gluon split-KV pass, ``portable``: the Triton kernel of ``kernel.py``, then ``split_kv``'s
combine) whether they support the call and binds the :class:`~llmkernels.launch.KernelSpec` each gives; ``config``
holds the configs and every tiling choice; ``layout`` the layout facts and per-call views of the tensors.
"""

from .api import attention
from .config import FA4Config, default_config
from .masks import Chunked, SlidingWindow, alibi, softcap
from .paged import PagedKVCache
from .reference import attention_reference

__all__ = [
    "attention",
    "FA4Config",
    "default_config",
    "PagedKVCache",
    "SlidingWindow",
    "Chunked",
    "softcap",
    "alibi",
    "attention_reference",
]
