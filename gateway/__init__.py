"""edgegw's HTTP face and the orchestration of the other packages.

The one-way data path, one module per step::

    client ─► admission.py   AdmissionApp: request id, draining, body (limit, timeout), in-flight
                             slot, disconnect watcher; a RequestContext for the rest
           ─► endpoints.py   CompletionsApp / WebSocketApp: parse (openai.py), then
           ─► pipeline.py    cache plan (caching.py) ─► hit: replay | follow | route ─► open ─► cascade
           ─► dispatch.py    routing's decision; open with fallbacks; hedging (HedgedReply)
           ─► fleet.py       pools (upstream/), the edge engine (edge.py in-process, or
                             edge_client.py: the node's engine process), probes, discovery;
                             HealthFeed, the one place routing's health is fed
           ─► replies.py     the Reply a request gets, whatever produced it
           ─► relay.py       SSE / WebSocket framing, measured events, keep-alives; the
                             splice (events from the upstream's callback to the socket)
    client ◄─

``app.py`` builds it all (``create_app``) and owns the lifespan; ``settings.py`` reads the
configuration once; ``observability.py`` holds the stage timer and the metrics;
``errors.py`` the error tree and its OpenAI-shaped responses; ``forwarding.py`` which
request headers go upstream; ``cli.py`` the ``edgegw`` command; ``workers.py`` the
supervising parent of ``listen.workers`` relay processes and the node's engine process,
``node.py`` what a worker knows of its node (its sockets, the node's ``/metrics``).

Vocabulary (used the same way in code, metrics and docs):

- *endpoint*: one configured upstream URL (an OpenAI base URL, e.g. ``http://10.0.0.5:8000/v1``);
- *cluster*: endpoints serving the same models in one region;
- *target*: what routing picked for a request: the edge engine, an endpoint, or the cache;
- *reply*: what answers a request (upstream, engine, cache replay, single-flight follower);
- *answer*: a reply plus what the response headers say about how it was found;
- *tenant*: whose request it is (the cache never shares entries between tenants);
- ASGI application classes end in ``App``.
"""
