"""delaymq.net: the trio layer around the sans-IO protocol.

``server.FrameServer`` answers requests on a listener and ``peers.open_peers`` makes them,
both over ``connection.Connection``s; ``limits.Limits`` says what connections may hold
(``admission``), how they are secured (``tls``) and which tokens may do what (``auth``,
``ratelimit``); ``serving`` runs a server's listener and tasks; ``testing`` is an in-memory
network for tests.
"""
