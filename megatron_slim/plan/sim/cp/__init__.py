"""The context-parallel simulator, pure Python (no torch): ``sim`` simulates a batch of packs under
an engine; ``layer`` builds one decoder layer's task graph, whose attention ``attention`` prices
by walking the CP step program (``ring`` one ring's steps, ``network`` the transfers on the
topology); ``events`` is the discrete-event engine that runs it; ``trace`` and ``plot`` export it.
"""
