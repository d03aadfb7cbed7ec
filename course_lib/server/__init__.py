"""The HTTP server (SGLang's weight-sync protocol) and its client.

- ``app.create_app(engine, ...)``: the FastAPI app; ``runner.BackgroundServer`` serves it
  from a thread; ``python -m course_lib serve --model PATH`` serves it from the command line.
- ``client.EngineClient``: one method per endpoint, and ``sync_weights`` (the RL flow).

Nothing is imported here: the HTTP stack is an optional extra (``pip install -e ".[server]"``).
"""
