"""core/: the values that cross rooms, and the pieces every room stands on.

Owns: the configuration (``settings.py`` assembles ``Settings`` from ``settings_listen``,
``settings_upstream``, ``settings_edge``, ``settings_tenants`` and ``settings_observe``;
``config_file.py`` reads the YAML, ``cpus.py`` counts CPUs: read once, validated, frozen,
passed down, as aioquic's ``QuicConfiguration`` is), the error tree and its OpenAI-shaped bodies
(``errors.py``), the OpenAI request as parsed once (``openai.py``), the request's context
and the typed records each stage writes into it (``context.py``), its ``Deadline``
(``deadline.py``), its ``Tenant`` (``tenant.py``), its stage clock (``timing.py``), SSE and
WebSocket framing with the event reader (``sse.py``) and the one-sweep timeouts
(``timeouts.py``).

May import: ``routing``, ``cache`` and ``edge_engine``'s torch-free modules (their
configuration and validation), and nothing else of the gateway.
"""
