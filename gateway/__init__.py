"""edgegw's gateway: its HTTP face and the orchestration of the other packages
(``routing``, ``cache``, ``edge_engine``).

The rooms along the data path, what each owns and may import, and the vocabulary are in
``docs/architecture.md``; each subpackage's docstring says the same for itself.
"""
