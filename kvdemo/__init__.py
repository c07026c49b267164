"""kvdemo: the composition root of ``kvevents demo`` (engines, tiered managers, router, recorder).

The one package that imports ``kvevents``, ``manager`` and ``consumers`` together.
"""
