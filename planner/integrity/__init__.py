"""The integrity verifier (SENTINEL-style): monitors of the tensors crossing stage boundaries.

The executor enters it through one interface, ``hooks`` (``VerifyHooks`` to check what a
rank receives, ``AttackHooks`` to rehearse attacks); ``verifier`` holds the monitors,
``distances``/``predictors`` the tests, ``thresholds`` the fences, ``evidence`` the blame.
"""
