"""Our Phi-3-vision ``trust_remote_code`` files.

``configuration_phi3_v.py`` and ``processing_phi3_v.py`` are copied verbatim
into every model directory by :mod:`serve.models.build`; each is self-contained
(no imports from this package), as transformers' dynamic module loader requires.
"""
