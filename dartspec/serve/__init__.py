"""OpenAI-compatible server: ``dartspec serve`` (see :mod:`dartspec.serve.app`)."""
