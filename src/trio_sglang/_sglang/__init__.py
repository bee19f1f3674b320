"""The real SGLang behind the engine protocol.

``SGLangEngine`` and what it reads from the installed release (its
semantics, its close, its scheduler's echoes), SGLang's own server
application as ``serve`` hosts it, its server arguments on the command line,
and what SGLang's CPU engine needs before it loads.
"""
