"""node/: one machine's edgegw: the app assembled, its lifespan, the command line, the
workers and the engine process under one supervisor.

Owns: ``create_app`` and the ``Gateway`` it runs (``app.py``), ``edgegw serve |
check-config | explain | bench | build-kernels`` (``cli.py``), the supervising parent of
``listen.workers`` relay processes and the node's engine process (``workers.py``), and
what a worker knows of its node (``siblings.py``: its sockets, its siblings), and live
configuration reload (``reload.py``).

The top of the gateway: it may import every other room; nothing imports it.
"""
