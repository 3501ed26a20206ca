"""The front door: what a person types and what starts the daemon.

- ``cli``: the ``trainwatch`` command; ``verbs`` its verbs with their help; ``options`` the
  daemon's options (one table: flags, environment, defaults); ``manual`` the man page and
  completions generated from them.
- ``service``: the daemon as a service (the web server, signals, the log); ``run`` wraps a
  job (``trainwatch run``); ``doctor`` says what this node lets the daemon see.
- ``postmortems``: where ``trainwatch postmortem`` finds its document (a URL, a path, an id).
- ``demo``: a real job that dies for real (``demo_worker`` is its rank), its postmortem shown.
"""
