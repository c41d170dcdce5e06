"""CPU inference engine serving the built-in tiny policy over the SGLang native HTTP subset.

Consumes: HTTP calls from proxies (``/generate``, ``/abort_request``) and from the
weight broadcaster (``/update_weights_from_disk``); checkpoint files written by the
trainer under ``weights_dir`` (``shared.checkpoint`` format).
Produces: sampled tokens with logprobs and the weight version that produced them;
Prometheus metrics on ``/metrics``.
Owns: the weights being served and their version label, the set of active requests
and the batched decode loop (``batcher.py`` is the pure state machine, ``runner.py``
the asyncio driver, ``app.py`` the HTTP shell). On GPUs a real SGLang server fills
this slot; nothing else in rein depends on this package.
"""
