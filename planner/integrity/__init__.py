"""The integrity verifier (SENTINEL-style): monitors of the tensors crossing stage boundaries.

The executor enters it through one interface, ``hooks`` (``VerifyHooks`` to check what a
rank receives, ``AttackHooks`` to rehearse attacks). ``verifier`` holds a rank's monitors and
bans, ``monitor`` one boundary's (``history`` its replay memory); ``summaries`` is what a tensor
is reduced to, ``distances`` / ``predictors`` the tests, ``thresholds`` the fences, ``evidence``
which excesses make a flag, ``blame`` whom a step's flags point at, ``bans`` the ban test.
"""
