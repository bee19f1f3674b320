"""The cancellation lifecycle: the worker, its streams, and who stops a request at the engine.

Apart from the rest, as trio's ``_core`` is: it knows an engine only through
the ``Engine`` protocol (``_engine.py``) and SGLang's request only through
its checks (``_request/_parse.py``, ``_request/_fields.py``), and nothing it imports imports
it back. The HTTP server, the Dynamo backend, the SimEngine and the SGLang
adapter are built on it; ``trio_sglang`` re-exports its public names.
"""
